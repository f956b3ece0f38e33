"""Data: built-in datasets, drafter corpora, caption encoders, image grids."""
