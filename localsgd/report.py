"""`python -m localsgd.report PATH [PATH ...]`: tables and plots (`localsgd.analysis.report`)."""

import sys

from localsgd.analysis.report import main

if __name__ == "__main__":
    sys.exit(main())
