"""`python -m hetsched.cli`: the command line, as `python -m hetsched` and the console script run it."""

from hetsched.cli import app

if __name__ == "__main__":
    app()
