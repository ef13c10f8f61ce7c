"""The ``cuda`` backend (being written; reports itself unavailable until then)."""

from quantcore.backend import Availability, Backend


class _Pending(Backend):
    name = "cuda"

    def availability(self) -> Availability:
        return Availability(False, "the cuda backend is not built in this version")


def create() -> Backend:
    return _Pending()
