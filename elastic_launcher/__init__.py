"""elastic_launcher package."""
