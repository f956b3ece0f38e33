"""Prefect tasks: one per pipeline stage, each a call of lisa.stages.run_stage; they pass paths and metrics, never
tensors. The lines a flow run stores name their task (tasks.logs)."""
