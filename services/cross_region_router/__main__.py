"""`python -m services.cross_region_router`"""

from services.cross_region_router.app import SERVICE, bootstrap
from shared.infra.service import run_service

if __name__ == "__main__":
    run_service(bootstrap, name=SERVICE.name)
