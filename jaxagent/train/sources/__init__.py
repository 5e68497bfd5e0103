"""Where a run's episodes come from."""
