"""Which endpoints are in rotation: active probes, passive ejection, the workers' load.

Each replica judges for itself (no shared state): an endpoint leaves rotation after
`unhealthy_after` failed `GET /health` probes, or at once when a request cannot connect to
it, or after `passive_5xx` 5xx answers in a row (Envoy's outlier detection, simplified). A
passively ejected endpoint stays out for a back-off that doubles with each ejection, then
comes back with its next good probe. Endpoints with `metrics: true` also have their
`/metrics` read on each probe: queue length and KV-cache use become a penalty that steers
new requests to less loaded workers. Endpoints with a token budget to read (`auto`) or to
adapt have it read too, for that alone (routing/hop/budgets.py). Changes reach admission
through `on_change`: a probe round's changes in one call, after the round.

Probes go over the aiohttp session it is given at start, else over a session of its own
(the gateway's case: the hop's connections are routing/hop/client.py's, not aiohttp's).

Signals about a URL this Health does not know are ignored: after a config reload, requests
still running on an endpoint that left report on it, and nothing on their path may fail.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import aiohttp
from pydantic import BaseModel, ConfigDict, Field

from routing.background import BackgroundErrors, every
from routing.choice.penalty import penalty as load_penalty
from routing.hop import scrape
from routing.hop.budgets import TokenBudgets
from routing.hop.scrape import Reading
from routing.registry import Model

log = logging.getLogger("gateway.health")

# The most endpoints a replica probes a second, on average: a round probes at most this
# many times `interval_s` (50 at the default 5 s). Past that many endpoints, a round
# probes those out of rotation (or failing, or whose budget was never read) and the next
# ones in turn of the rest, so each endpoint in rotation is probed every len / PROBES_PER_S
# seconds (100 s at 1,000) and a replica's probing costs the same whatever the fleet's size.
# Real traffic is the signal between: a request that cannot connect ejects its endpoint at
# once, 5xx in a row do (`answered`), and an answer counts as a good probe.
PROBES_PER_S = 10
# The most of a worker's answer a probe reads (a vLLM's /metrics is some 100 KB; one with
# many LoRA adapters a few MB): past it, the answer is not read further.
MAX_BODY_BYTES = 8 << 20


class HealthSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    interval_s: float = Field(5.0, gt=0, le=300)
    timeout_s: float = Field(2.0, gt=0, le=60)
    unhealthy_after: int = Field(2, ge=1, le=100)  # failed probes in a row
    healthy_after: int = Field(1, ge=1, le=100)  # good probes in a row
    passive_5xx: int = Field(3, ge=1, le=1000)  # 5xx answers in a row
    ejection_s: float = Field(5.0, gt=0, le=3600)  # first passive ejection; doubles
    max_ejection_s: float = Field(120.0, gt=0, le=86400)


@dataclass
class EndpointHealth:
    url: str
    size: int  # the largest max_concurrency any model gives it: scales its queue penalty
    scrape: bool  # its /metrics make a penalty (`metrics: true`)
    up: bool = True
    failed_probes: int = 0
    good_probes: int = 0
    errors_5xx: int = 0
    ejected_until: float = 0.0
    ejections: int = 0
    up_since: float = 0.0
    penalty: float = 0.0
    told_too_large: bool = False


class Health:
    _turn = 0  # where the next round's probes of the rest begin (`_due`)

    def __init__(
        self,
        models: Iterable[Model],
        settings: HealthSettings,
        on_change: Callable[[set[str]], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        errors: BackgroundErrors | None = None,
    ) -> None:
        self.settings = settings
        self._on_change = on_change
        self._clock = clock
        self._errors = errors if errors is not None else BackgroundErrors()
        self.endpoints: dict[str, EndpointHealth] = {}
        models = list(models)
        self.budgets = TokenBudgets(models, clock)
        # While a probe round's results are applied: the endpoints changed, told after.
        self._round: set[str] | None = None
        for model in models:
            for e in model.config.endpoints:
                known = self.endpoints.get(e.base_url)
                if known is None:
                    self.endpoints[e.base_url] = EndpointHealth(
                        e.base_url, e.max_concurrency, e.metrics, up_since=clock()
                    )
                else:
                    known.size = max(known.size, e.max_concurrency)
                    known.scrape = known.scrape or e.metrics
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._owns_session = False
        # The one thread that parses the workers' /metrics (`_parse`), made at the first
        # parse and ended by `close`.
        self._parser: ThreadPoolExecutor | None = None
        # Each of connecting (a free connection from the pool included) and every read
        # is bounded by the probe timeout (the whole probe too: `_probe`); a redirect is an
        # answer, not followed.
        self._timeout = aiohttp.ClientTimeout(
            connect=settings.timeout_s, sock_read=settings.timeout_s
        )

    def adopt(self, previous: Health) -> None:
        """A config reload: endpoints this one shares with `previous` keep their state."""
        for url, known in previous.endpoints.items():
            mine = self.endpoints.get(url)
            if mine is not None:
                known.size, known.scrape = mine.size, mine.scrape
                self.endpoints[url] = known
        self.budgets.adopt(previous.budgets)

    def is_up(self, url: str) -> bool:
        health = self.endpoints.get(url)
        return health is not None and health.up

    def penalty(self, url: str) -> float:
        health = self.endpoints.get(url)
        return health.penalty if health is not None else 0.0

    def budget(self, model: str, url: str) -> int | None:
        """`model`'s token budget on the endpoint now (None: none, or not known yet)."""
        return self.budgets.budget(model, url)

    def whole_budget(self, model: str, url: str) -> int | None:
        """`model`'s token budget on the endpoint unadapted (None: none, or not known yet)."""
        return self.budgets.whole(model, url)

    # --- passive signals from real requests ---------------------------------------------

    def unreachable(self, url: str) -> None:
        """A request could not connect (or was reset before any answer): out at once."""
        health = self.endpoints.get(url)
        if health is not None:
            self._eject(health, "unreachable")

    def answered(self, url: str, status: int) -> None:
        health = self.endpoints.get(url)
        if health is None:
            return
        if status < 500:
            health.errors_5xx = health.failed_probes = 0  # (as good as a probe)
            return
        health.errors_5xx += 1
        if health.errors_5xx >= self.settings.passive_5xx:
            self._eject(health, f"{health.errors_5xx} 5xx answers in a row")

    def _eject(self, health: EndpointHealth, why: str) -> None:
        now = self._clock()
        if not health.up and now < health.ejected_until:
            return
        if now - health.up_since > self.settings.max_ejection_s:
            health.ejections = 0  # it behaved for a while: start the back-off again
        health.ejections += 1
        backoff = self.settings.ejection_s * 2 ** (health.ejections - 1)
        health.ejected_until = now + min(self.settings.max_ejection_s, backoff)
        health.good_probes = health.errors_5xx = 0
        log.warning("endpoint %s out of rotation for %.0fs: %s", health.url, backoff, why)
        self._set(health, False)

    # --- active probes -------------------------------------------------------------------

    def probed(self, url: str, ok: bool, reading: Reading | None = None) -> None:
        """A probe's result: its health, and what its worker's /metrics said (None: not read)."""
        health = self.endpoints.get(url)
        if health is None:
            return
        penalty = None
        if health.scrape and reading is not None:
            penalty = load_penalty(reading.waiting, reading.kv_usage, health.size)
        if penalty is not None and abs(penalty - health.penalty) > 0.02:
            health.penalty = penalty
            if health.up:
                self._changed(url)
        if self.budgets.observe(url, reading):
            self._changed(url)
        if not ok:
            health.good_probes = 0
            health.failed_probes += 1
            if health.up and health.failed_probes >= self.settings.unhealthy_after:
                log.warning("endpoint %s out of rotation: health probes fail", url)
                self._set(health, False)
            return
        health.failed_probes = 0
        health.good_probes += 1
        ready = health.good_probes >= self.settings.healthy_after
        if not health.up and ready and self._clock() >= health.ejected_until:
            log.info("endpoint %s back in rotation", url)
            self._set(health, True)

    def _set(self, health: EndpointHealth, up: bool) -> None:
        if health.up != up:
            health.up = up
            if up:
                health.up_since = self._clock()
            self._changed(health.url)

    def _changed(self, url: str) -> None:
        if self._round is not None:
            self._round.add(url)
        else:
            self._on_change({url})

    async def start(self, session: aiohttp.ClientSession | None = None) -> None:
        """Probe every `interval_s` over `session` (shared: left open on close), else over
        a session of its own."""
        self._owns_session = session is None
        self._session = session if session is not None else aiohttp.ClientSession()
        # Through `every`: an unexpected error in one round (a worker's odd /metrics, a
        # failing `on_change`) is counted and the next round runs.
        probing = every("health", self.settings.interval_s, self.probe_all, self._errors)
        self._task = asyncio.get_running_loop().create_task(probing)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None and self._owns_session:
            await self._session.close()
        self._session = None
        if self._parser is not None:
            # Not waited for: a parse under way (its probe cancelled) ends on its own.
            self._parser.shutdown(wait=False, cancel_futures=True)
            self._parser = None

    async def probe_all(self) -> None:
        """One round: every endpoint probed, its results applied and their changes told in
        one `on_change` (one write to admission per round, of what changed), even when one
        probe fails unexpectedly; that failure is raised once all are done (for the loop
        to count)."""
        healths = self._due()
        results = await asyncio.gather(*map(self._probe, healths), return_exceptions=True)
        failure: BaseException | None = None
        changed: set[str] = set()
        self._round = changed
        try:
            for health, result in zip(healths, results, strict=True):
                try:
                    if isinstance(result, BaseException):
                        raise result
                    self.probed(health.url, *result)
                except Exception as exc:  # raised below, once the others are applied
                    failure = failure or exc
        finally:
            self._round = None
            if changed:
                self._on_change(changed)
        if failure is not None:
            raise failure

    def _due(self) -> list[EndpointHealth]:
        """The endpoints this round probes: all of them up to the round's budget
        (PROBES_PER_S); past it, those out of rotation, failing or never read, and the next
        ones in turn of the rest (in the endpoints' order, from where the last round ended)."""
        healths = list(self.endpoints.values())
        budget = max(1, int(PROBES_PER_S * self.settings.interval_s))
        if len(healths) <= budget:
            return healths

        def first(h: EndpointHealth) -> bool:
            return not h.up or h.failed_probes > 0 or self.budgets.unread(h.url)

        due = [h for h in healths if first(h)]
        start, n = self._turn % len(healths), len(healths)
        for step in range(n):
            if len(due) >= budget:
                break
            h = healths[(start + step) % n]
            if not first(h):
                due.append(h)
            self._turn = start + step + 1
        return due

    async def _probe(self, health: EndpointHealth) -> tuple[bool, Reading | None]:
        """GET /health, then /metrics where something is read from it: both within
        `timeout_s` together (docs/config.md: "a probe slower than this failed"), so a
        round takes at most that, whatever an endpoint reads. The parse is this replica's
        own work, not the worker's: it waits its turn outside the timeout."""
        load, cache = self.budgets.needs(health.url)
        page = props = None
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                ok = (await self._get(health.url + "/health"))[0] == 200
                if ok and (health.scrape or load or cache):
                    page = await self._read(health, "/metrics")
                if cache and page is not None and scrape.LLAMA in page:
                    props = await self._read(health, "/props")  # llama.cpp's cache size
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False, None
        if page is None:
            return ok, None
        return ok, await self._parse(page, health.scrape or load, cache, props)

    async def _read(self, health: EndpointHealth, path: str) -> str | None:
        """One of the worker's pages; None when it did not answer 200 or is too large."""
        status, text = await self._get(health.url + path)
        if text is None and not health.told_too_large:
            health.told_too_large = True
            log.warning(
                "endpoint %s: %s larger than %d bytes, not read", health.url, path, MAX_BODY_BYTES
            )
        return text if status == 200 else None

    async def _parse(self, text: str, load: bool, cache: bool, props: str | None) -> Reading:
        """The page parsed off the event loop: a hostile one (8 MiB of one label set) takes
        the parser most of a second, which the replica's requests must not wait out. On one
        thread of its own, one page at a time: a round of 1,000 endpoints queues its parses
        there, not on the loop's default executor (which others share), and parser threads
        never contend for the GIL with each other."""
        if self._parser is None:
            self._parser = ThreadPoolExecutor(1, thread_name_prefix="gateway-health-parse")
        read = partial(scrape.read, text, load=load, cache=cache, props=props)
        return await asyncio.get_running_loop().run_in_executor(self._parser, read)

    async def _get(self, url: str) -> tuple[int, str | None]:
        """Status and body, the whole body read (an answer that breaks off is a failure);
        None for a body larger than MAX_BODY_BYTES (not read further). Within the probe's
        timeout (`_probe`): a worker that trickles its answer fails the probe, and holds up
        no round (TimeoutError)."""
        assert self._session is not None
        get = self._session.get(url, timeout=self._timeout, allow_redirects=False)
        async with get as response:
            body = bytearray()
            async for chunk in response.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    return response.status, None
            return response.status, body.decode(errors="replace")
