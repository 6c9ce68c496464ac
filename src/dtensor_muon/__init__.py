"""dtensor_muon: exact owner-rank distributed Muon for PyTorch FSDP2/DTensor."""
