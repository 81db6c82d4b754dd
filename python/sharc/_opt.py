"""`sharc-opt`: runs the C++ tool installed with sharc (tools/sharc_opt.cpp):
an IR file and a pass pipeline as text in, the scheduled IR out. It
replays a schedule dumped by CompileConfig(dump_ir=...):

    sharc-opt DIR/rank0_000_forward.before.ir --pipeline-file DIR/rank0_000_forward.pipeline
"""

import os
import sys
from pathlib import Path

_TOOL = Path(__file__).parent / "bin" / "sharc-opt"


def main() -> None:
    if not _TOOL.exists():
        sys.exit(f"sharc-opt: the tool is missing ({_TOOL}); reinstall sharc with "
                 "scripts/setup.sh")
    os.execv(_TOOL, [str(_TOOL), *sys.argv[1:]])


if __name__ == "__main__":
    main()
