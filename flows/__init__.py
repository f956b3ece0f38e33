"""Prefect flows: they only compose the tasks in tasks/. Deployments live in prefect.yaml."""
