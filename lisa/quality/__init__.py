"""Quality: FID / KID, judges, reference sets, the premise measurements."""
