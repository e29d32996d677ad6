"""Worked answers to the lab's exercises, one file per template, same interface."""
