"""`python -m minivllm` is the `minivllm` command."""

from minivllm.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
