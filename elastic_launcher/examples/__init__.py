"""Training scripts of the sbatch templates (sbatch_templates/), written against ElasticTrainer.

Each module runs as `python -m elastic_launcher.examples.<name>` under `elastic-launch` (one process per
GPU slot). `common` holds the entry-point code they share (worker identity, device, the training loop);
`models` and `data` hold the small model and dataset code used when torchvision / transformers are absent.
"""
