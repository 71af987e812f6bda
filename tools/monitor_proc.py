"""SPEC §9's name for `minivllm monitor`: python tools/monitor_proc.py --pid PID --duration S [--interval]
[--out X.csv] [--plot]."""

import sys

from minivllm.cli import main

if __name__ == "__main__":
    sys.exit(main(["monitor", *sys.argv[1:]]))
