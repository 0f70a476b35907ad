"""MLflow entry point `audit_frame`: parse the parameters, run the stage (see mistill.stages.registry).

The same as `mistill audit_frame ...`; `--help` lists the parameters with their meaning and default.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mistill.stages.cli import main  # noqa: E402

if __name__ == "__main__":
    main("audit_frame")
