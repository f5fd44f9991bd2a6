"""Former home of the benchmark helpers; they live in :mod:`benchmarks.harness` now.

Kept so that scripts written against ``benchmarks.common`` keep working; new code imports
``benchmarks.harness``.
"""

from benchmarks.harness import RESULTS, best_time, machine, markdown_table, write_results

__all__ = ["RESULTS", "best_time", "machine", "markdown_table", "write_results"]
