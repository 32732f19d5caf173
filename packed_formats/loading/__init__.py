"""The read path: from an archive to batches on the device (make_loader, PackedLoader,
PackedDataset, sampling, workers, shared-memory slots, device delivery, resume).
"""
