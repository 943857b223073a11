"""Beyond one device: ring attention over ``torch.distributed``."""
