"""Measurement: communication counted where strategies call torch.distributed, memory counted from
the tensors each rank holds plus peak RSS, and step time split into phases."""
