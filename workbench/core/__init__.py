"""Pure Python + numpy model of the product: inventory, placement, stats, cost model, planner, files.

Nothing in this package imports torch or Qt (checked by import-linter).
"""
