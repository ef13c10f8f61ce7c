"""The ``sycl`` backend (being written; reports itself unavailable until then)."""

from quantcore.backend import Availability, Backend


class _Pending(Backend):
    name = "sycl"

    def availability(self) -> Availability:
        return Availability(False, "the sycl backend is not built in this version")


def create() -> Backend:
    return _Pending()
