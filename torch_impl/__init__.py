"""The chapter's attention modules in PyTorch, on any device."""
