"""`python -m hetsched`: the command line, as the `hetsched` console script runs it."""

from hetsched.cli import app

if __name__ == "__main__":
    app()
