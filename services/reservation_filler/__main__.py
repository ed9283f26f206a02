"""`python -m services.reservation_filler`"""

from services.reservation_filler.app import SERVICE, bootstrap
from shared.infra.service import run_service

if __name__ == "__main__":
    run_service(bootstrap, name=SERVICE.name)
