"""`python -m services.gateway` (what `hetsched gateway` runs)."""

from services.gateway.app import SERVICE, bootstrap
from shared.infra.service import run_service

if __name__ == "__main__":
    run_service(bootstrap, name=SERVICE.name)
