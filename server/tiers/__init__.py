"""The host tier's memory and the copies between it and the GPU arena."""
