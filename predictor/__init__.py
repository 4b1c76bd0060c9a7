"""predictor package."""
