"""`python -m services.topology_discovery`"""

from services.topology_discovery.app import SERVICE, bootstrap
from shared.infra.service import run_service

if __name__ == "__main__":
    run_service(bootstrap, name=SERVICE.name)
