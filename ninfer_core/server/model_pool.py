"""Models served by name, as Ollama and LM Studio do: a request's `model` picks the model; one not in
memory is loaded on demand (one EngineService per loaded model), at most `max_loaded` at once
(the least recently used idle one makes room), and a model loaded on demand is unloaded after
`keep_alive_s` without requests. The startup model (`ninfer serve MODEL`, the TUI's own) stays
until another model needs its place; a borrowed service (the TUI's chat engine) is never unloaded.

Every request holds a Lease from submission to its last byte, so a model is never unloaded under a
running request; a request for a model that cannot get a place waits until one is idle.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..engine.service import EngineService
from ..errors import NinferError
from ..llm import LLM
from .errors import ApiError
from .keep_alive import FOREVER

log = logging.getLogger(__name__)

DEFAULT_KEEP_ALIVE_S = 300.0
DEFAULT_WAIT_S = 600.0  # a request waits this long for a busy pool to free a place


class ModelNames(Protocol):
    """What can be served: every name, and the (name, what the loader loads) a requested name means."""

    def names(self) -> list[str]: ...

    def find(self, requested: str) -> tuple[str, str] | None: ...


@dataclass
class CatalogNames:
    """The startup model plus every model of this machine's catalog (pulled, local, embedded), read
    at each lookup so a model pulled while the server runs is served without a restart."""

    startup: tuple[str, str] | None = None  # (name, spec)

    def names(self) -> list[str]:
        from ..hub import list_models

        startup = [self.startup[0]] if self.startup else []
        return list(dict.fromkeys([*startup, *(m.name for m in list_models())]))

    def find(self, requested: str) -> tuple[str, str] | None:
        from ..hub import find_model

        if self.startup is not None and requested.lower() in (self.startup[0].lower(), self.startup[1].lower()):
            return self.startup
        found = find_model(requested)
        if found is None:
            return None
        if self.startup is not None and found.answers_to(self.startup[0]):
            return self.startup
        return found.name, str(found.path)


@dataclass
class FixedNames:
    """Exactly the models given (name -> spec), e.g. the TUI's one model."""

    models: dict[str, str] = field(default_factory=dict)

    def names(self) -> list[str]:
        return list(self.models)

    def find(self, requested: str) -> tuple[str, str] | None:
        return next(((n, s) for n, s in self.models.items() if n.lower() == requested.lower()), None)


@dataclass(frozen=True)
class PoolOptions:
    max_loaded: int = 1
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S  # FOREVER: never unload for idleness
    wait_s: float = DEFAULT_WAIT_S

    def __post_init__(self) -> None:
        if self.max_loaded < 1:
            raise NinferError(f"--max-loaded must be at least 1, got {self.max_loaded}")
        if not self.keep_alive_s >= 0:
            raise NinferError(f"--keep-alive must not be negative, got {self.keep_alive_s}")


@dataclass
class Resident:
    """A model in memory and its engine."""

    name: str
    service: EngineService
    loaded_at: float
    last_used: float
    startup: bool = False  # the startup model: no keep-alive expiry unless a request sets one
    borrowed: bool = False  # the caller's service: never stopped or unloaded here
    leases: int = 0
    keep_alive_s: float | None = None  # the last request's own (Ollama's keep_alive); None: the default

    def expires_at(self, default_s: float) -> float | None:
        """When the model unloads if no request comes (None: never)."""
        keep = self.keep_alive_s if self.keep_alive_s is not None else FOREVER if self.startup else default_s
        if self.borrowed or keep == FOREVER:
            return None
        return self.last_used + keep


class Lease:
    """One request's hold on a loaded model; `release()` once its response has ended."""

    def __init__(self, pool: ModelPool, resident: Resident):
        self.name = resident.name
        self.service = resident.service
        self._pool = pool
        self._resident = resident
        self._released = False

    def keep_alive(self, seconds: float) -> None:
        """This request's keep-alive (Ollama's): how long the model stays after its last request,
        from now until a request without one resets it to the default. Ignored by a pool that could
        not load the model again (no loader: a server given one model)."""
        if self._pool.reloads:
            self._resident.keep_alive_s = seconds

    def share(self) -> Lease:
        """Another hold on the same model (one per choice of an `n` > 1 request: each ends on its own)."""
        self._pool._retain(self._resident)
        return Lease(self._pool, self._resident)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._pool._release(self._resident)
            del self._resident, self.service  # a finished request must not keep an unloaded model alive


class ModelPool:
    def __init__(self, names: ModelNames, make_service: Callable[[LLM], EngineService],
                 loader: Callable[[str], LLM] | None = None, options: PoolOptions | None = None,
                 default: str | None = None):
        """`loader(spec)`: loads a model on demand (None: only what is added is served);
        `default`: the name a request without `model` gets."""
        self.names = names
        self.options = options or PoolOptions()
        self.default = default
        self.default_error: str | None = None  # the startup model's load failure
        self._make_service = make_service
        self._loader = loader
        self._cond = threading.Condition()
        self._residents: dict[str, Resident] = {}
        self._loading: set[str] = set()
        self._closed = False
        self.created = int(time.time())
        self._reaper = threading.Thread(target=self._reap, name="ninfer-keep-alive", daemon=True)
        self._reaper.start()

    @property
    def reloads(self) -> bool:
        """Whether a model unloaded here can be loaded again on demand."""
        return self._loader is not None

    # -- adding the startup model ---------------------------------------------------------------

    def add(self, name: str, service: EngineService, *, borrowed: bool = False) -> None:
        """Make a started service resident as the startup model."""
        now = time.time()
        with self._cond:
            self._residents[name] = Resident(name, service, now, now, startup=True, borrowed=borrowed)
            self._cond.notify_all()

    def load_startup(self, name: str, load: Callable[[], LLM]) -> None:
        """Load the startup model in the background (requests for it wait, /health says 503)."""
        with self._cond:
            self._loading.add(name)

        def run() -> None:
            try:
                service = self._make_service(load())
            except Exception as e:  # noqa: BLE001 - reported by /health and every request for it
                log.exception("loading %s failed", name)
                with self._cond:
                    self.default_error = str(e)
                    self._loading.discard(name)
                    self._cond.notify_all()
                return
            with self._cond:
                self._loading.discard(name)
                if self._closed:
                    service.stop()
                    return
            self.add(name, service)

        threading.Thread(target=run, name="ninfer-load", daemon=True).start()

    # -- serving --------------------------------------------------------------------------------

    def resolve(self, requested: str | None) -> tuple[str, str]:
        """(name, spec) of a requested model; None or "" means the default. 404 for an unknown name."""
        if not requested:
            if self.default is None:
                raise ApiError(400, "the request names no model", param="model", code="model_not_found")
            requested = self.default
        found = self.names.find(requested)
        if found is None:
            available = self.names.names()
            raise ApiError(404, f"the model '{requested}' does not exist; this server serves: "
                                f"{', '.join(available) or 'nothing'}", param="model", code="model_not_found",
                           extra={"available": available})
        return found

    def lease(self, requested: str | None) -> Lease:
        """The requested model, loaded if need be (blocking: call it off the event loop)."""
        name, spec = self.resolve(requested)
        deadline = time.time() + self.options.wait_s
        with self._cond:
            while True:
                self._check_startup(name)
                resident = self._residents.get(name)
                if resident is not None:
                    resident.leases += 1
                    resident.last_used = time.time()
                    resident.keep_alive_s = None  # each request sets its own (Ollama's) or the default
                    return Lease(self, resident)
                if name not in self._loading:
                    victim = self._make_room()
                    if victim is not False:
                        self._loading.add(name)
                        break
                if not self._cond.wait(timeout=max(0.0, deadline - time.time())):
                    raise ApiError(503, f"all {self.options.max_loaded} loaded model(s) are busy; '{name}' could not "
                                        f"be loaded (raise --max-loaded, or retry)", code="model_busy",
                                   headers={"Retry-After": "5"})
        self._unload(victim)
        del victim
        return self._load(name, spec)

    def check_default(self) -> None:
        """503 while the startup model loads or after it failed to (what /health reports)."""
        with self._cond:
            self._check_startup(self.default or "")

    def _check_startup(self, name: str) -> None:
        if name == self.default and name not in self._residents:
            if self.default_error is not None:
                raise ApiError(503, f"the model failed to load: {self.default_error}", code="model_load_failed")
            if name in self._loading:
                raise ApiError(503, "the model is still loading; retry shortly", code="model_loading",
                               headers={"Retry-After": "2"})

    def _make_room(self) -> Resident | None | bool:
        """With the lock held: None when there is room, the resident to unload (already out of the
        table), or False when every place is taken by a busy model."""
        if len(self._residents) + len(self._loading) < self.options.max_loaded:
            return None
        idle = [r for r in self._residents.values() if r.leases == 0 and not r.borrowed]
        if not idle:
            return False
        victim = min(idle, key=lambda r: r.last_used)
        del self._residents[victim.name]
        return victim

    def _load(self, name: str, spec: str) -> Lease:
        try:
            if self._loader is None:
                raise NinferError("this server loads no models on demand")
            service = self._make_service(self._loader(spec))
        except Exception as e:
            with self._cond:
                self._loading.discard(name)
                self._cond.notify_all()
            if isinstance(e, NinferError):
                raise ApiError(503, f"the model '{name}' failed to load: {e}", code="model_load_failed") from None
            raise
        now = time.time()
        resident = Resident(name, service, now, now, leases=1)
        with self._cond:
            self._loading.discard(name)
            self._residents[name] = resident
            self._cond.notify_all()
        log.info("loaded %s", name)
        return Lease(self, resident)

    def _retain(self, resident: Resident) -> None:
        with self._cond:
            resident.leases += 1

    def _release(self, resident: Resident) -> None:
        with self._cond:
            resident.leases -= 1
            resident.last_used = time.time()
            self._cond.notify_all()

    # -- unloading ------------------------------------------------------------------------------

    def unload(self, name: str) -> bool:
        """`ninfer stop`: unload a model now (its requests in flight end with an error); False if not loaded."""
        with self._cond:
            resident = next((r for r in self._residents.values() if r.name.lower() == name.lower()), None)
            if resident is None:
                return False
            if resident.borrowed:
                raise ApiError(409, f"'{resident.name}' is the chat's own model: it stays while the chat runs",
                               code="model_pinned")
            del self._residents[resident.name]
            self._cond.notify_all()
        self._unload(resident)
        return True

    def _unload(self, resident: Resident | None) -> None:
        """Stop a resident's engine and free its memory (the resident, out of the table, keeps no model)."""
        if resident is None or resident.borrowed:
            return
        service, resident.service = resident.service, None  # type: ignore[assignment]
        service.stop()
        device = service.llm.loaded.device
        del service
        gc.collect()  # the engine, cache and weights go now, not at some later collection
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    def _reap(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now, keep = time.time(), self.options.keep_alive_s
                expired = [r for r in self._residents.values()
                           if r.leases == 0 and (t := r.expires_at(keep)) is not None and t <= now]
                for r in expired:
                    del self._residents[r.name]
                if not expired:
                    self._cond.wait(timeout=1.0)
            for r in expired:
                log.info("unloading %s after %.0f s idle", r.name, now - r.last_used)
                self._unload(r)
            expired = []

    def close(self) -> None:
        with self._cond:
            self._closed = True
            residents, self._residents = list(self._residents.values()), {}
            self._cond.notify_all()
        for r in residents:
            if not r.borrowed:
                r.service.stop()

    # -- reading --------------------------------------------------------------------------------

    def residents(self) -> list[Resident]:
        with self._cond:
            return list(self._residents.values())

    def services(self) -> list[EngineService]:
        with self._cond:
            return [r.service for r in self._residents.values()]

    def service(self, name: str | None = None) -> EngineService | None:
        """The loaded service of a model (default: the default model), None if it is not loaded."""
        with self._cond:
            resident = self._residents.get(name or self.default or "")
            return resident.service if resident is not None else None

    def loading(self) -> list[str]:
        with self._cond:
            return sorted(self._loading)
