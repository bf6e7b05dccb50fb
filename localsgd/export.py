"""`python -m localsgd.export RUN_DIR`: a model=hf run's model as Hugging Face loads it (see
`localsgd.cli.export`)."""

import sys


def main() -> None:
    from localsgd.cli.export import main as export

    sys.exit(export())


if __name__ == "__main__":
    main()
