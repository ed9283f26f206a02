"""`python -m services.gateway` (what `hetsched gateway` runs)."""

from services.gateway.app import main

if __name__ == "__main__":
    main()
