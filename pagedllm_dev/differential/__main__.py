"""``python -m pagedllm_dev.differential``: see ``cli``."""

from pagedllm_dev.differential.cli import main

main()
