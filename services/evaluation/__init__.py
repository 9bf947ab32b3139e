"""Evaluation: per-task results of a checkpoint, statistics, and (separately) the gate."""
