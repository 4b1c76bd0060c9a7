"""The key layout of a job's store: every key the controller, the workers, the helper agents and
``elastic-launch ctl`` exchange, in one place.

The controller (``elastic-launch``) hosts one ``TCPStore`` per job; it outlives every worker. Keys live in
channels, each a ``PrefixStore`` prefix (``torch.distributed.PrefixStore(p, s)`` stores ``k`` as ``p/k``).
The builders below return keys *relative to their channel*; the full key is ``<channel>/<key>``. Only this
module spells a key or a prefix: the other modules call these builders (``tests/unit/test_store_keys.py`` fails
on a string-literal key at a store call anywhere else in ``elastic_launcher/``). Worker ids never contain ``/``.

``<p>`` is the prefix of the workers' store address (``ELASTIC_STORE_ADDR=host:port[/p]``). ``elastic-launch``
gives none, so ``<p>`` is empty and the trainer's channels start with ``/`` (``/elastic-state/speed/<wid>``).
The runtime and launcher channels are then at the top of the store, where the controller reads them.

Runtime channel, ``elastic/`` (:data:`RUNTIME`; ``membership.py``, ``rendezvous_state.py``, ``peer_watch.py``).
Membership is the one record ``state``, changed only by compare-and-set on its version; the other keys are reports,
each written by one party:

========================== ================================== ============================= ======================
key                        written by                         read by                       value
========================== ================================== ============================= ======================
``state``                  controller (first plan, resize);   workers' heartbeat threads,   JSON membership record
                           a switched epoch's rank 0; every   newcomers, controller         (``rendezvous_state``:
                           survivor of a recovery; all by                                   version, seq, epoch,
                           ``compare_set`` on the version                                   prev, pending,
                                                                                            recovery)
``hb/<wid>``               the worker's heartbeat thread      controller, recovering        ``time.time()``
                                                              survivors, peers' watch
``joined/<wid>``           the worker, once at start          -                             ``time.time()``
``joined``                 each worker, once (``append``)     controller                    ``"<wid>,<wid>,..."``
``switched/<id>``          rank 0 of plan ``id`` after its    controller                    JSON switch stats
                           first step
``left/<wid>``             a leaver, just before it exits     controller, peers' watch      ``time.time()``
========================== ================================== ============================= ======================

Launcher channel, ``launcher/`` (:data:`LAUNCHER`; ``control.py``, ``controller.py``, ``helper_agent.py``,
``workers.py``, ``observations.py``):

======================= ==================================== ============================== =====================
key                     written by                           read by                        value
======================= ==================================== ============================== =====================
``heartbeat``           controller, every 0.5 s (``add``)    helper agents                  counter
``status``              controller, every loop               ``elastic-launch ctl --status`` JSON controller state
``ctl/seq``             ``elastic-launch ctl`` (``add``)     controller                     counter: request n
``ctl/req/<n>``         ``elastic-launch ctl``               controller                     JSON ``{"nodes": N}``
``ctl/reply/<n>``       controller                           ``elastic-launch ctl``         JSON ``{"ok",
                                                                                            "message", ...}``
``helper/<job>/status`` the helper agent                     controller                     JSON (state, nodes,
                                                                                            steps, reason)
``helper/<job>/stop``   controller                           the helper agent               reason (text)
``progress/<wid>``      worker, at commit points             controller (throughput,        JSON progress record
                        (``ProgressReporter.report``)        stragglers, switch idle time)
``observations/<wid>``  worker (``append``, JSON lines)      controller (ObservationInbox)  JSON lines of records
``hosts/<wid>``         worker, once at start                controller (links of a layout) ``HostFacts`` JSON
======================= ==================================== ============================== =====================

The controller and ``ctl`` use the launcher channel through a ``PrefixStore``; workers write their
``progress``/``observations``/``hosts`` keys on an unprefixed client with the full key (:func:`progress`,
:func:`observations`, :func:`hosts` return full keys, ``launcher/...``).

Trainer channel, ``<p>/elastic-state/`` (:func:`state_channel`; ``rendezvous_client.py``, ``epochs.py``, ``state.py``):

=================== ====================================== =========================================== ==========
key                 written by                             read by                                     value
=================== ====================================== =========================================== ==========
``speed/<wid>``     the worker, once at construction       every member, entering an epoch (batch      float
                                                           split); never in the step
``state/<id>``      the state source of epoch ``id``       the other members of epoch ``id``           pickled
                                                                                                       skeleton
=================== ====================================== =========================================== ==========

Process-group rendezvous of epoch ``id``: ``<p>/epoch/<id>/`` (:func:`group_channel`; torch's own keys).
The torchrun wrapper example (``examples/wrap.py``): ``elastic-wrap/<id>/master`` (:func:`wrap_channel`,
:data:`WRAP_MASTER`), rank 0's ``host:port``.
"""
from __future__ import annotations

# ---- channels (store prefixes) -------------------------------------------------------------------------------
RUNTIME = "elastic"
LAUNCHER = "launcher"


def state_channel(base: str) -> str:
    """The trainer's channel under the worker's address prefix ``base`` (``"" -> "/elastic-state"``)."""
    return f"{base}/elastic-state"


def group_channel(base: str, epoch: int) -> str:
    """The process-group rendezvous prefix of ``epoch`` under the worker's address prefix ``base``."""
    return f"{base}/{epoch_group(epoch)}"


def epoch_group(epoch: int) -> str:
    """``epoch/<id>``: the part of :func:`group_channel` that names the epoch (``Plan.group_prefix``)."""
    return f"epoch/{epoch}"


def wrap_channel(epoch: int) -> str:
    """The torchrun wrapper example's channel of ``epoch`` (replaces the address prefix)."""
    return f"elastic-wrap/{epoch}"


# ---- runtime channel (relative to RUNTIME) ---------------------------------------------------------------------
STATE = "state"
JOINED_LIST = "joined"


def beat(wid: str) -> str:
    """A worker's heartbeat."""
    return f"hb/{wid}"


def joined(wid: str) -> str:
    return f"joined/{wid}"


def switched(epoch: int) -> str:
    return f"switched/{epoch}"


def left(wid: str) -> str:
    return f"left/{wid}"


# ---- launcher channel (relative to LAUNCHER) -------------------------------------------------------------------
CONTROLLER_BEAT = "heartbeat"
STATUS = "status"
CTL_SEQ = "ctl/seq"


def ctl_request(seq: int) -> str:
    return f"ctl/req/{seq}"


def ctl_reply(seq: int) -> str:
    return f"ctl/reply/{seq}"


def helper_status(helper_job: str) -> str:
    return f"helper/{helper_job}/status"


def helper_stop(helper_job: str) -> str:
    return f"helper/{helper_job}/stop"


# ---- worker reports: full keys (workers write them on an unprefixed client) ------------------------------------
def progress(wid: str) -> str:
    return f"{LAUNCHER}/progress/{wid}"


def observations(wid: str) -> str:
    return f"{LAUNCHER}/observations/{wid}"


def hosts(wid: str) -> str:
    return f"{LAUNCHER}/hosts/{wid}"


TOTAL_STEPS = f"{LAUNCHER}/total-steps"  # the steps the script trains (its --steps), for progress and ETA
MODEL_PROFILE = f"{LAUNCHER}/model-profile"  # the model the workers built (a POST /v1/profiles body), for registering


# ---- trainer channel (relative to state_channel(base)) ---------------------------------------------------------
def speed(wid: str) -> str:
    return f"speed/{wid}"


def state(epoch: int) -> str:
    """The state skeleton broadcast on entering ``epoch``."""
    return f"state/{epoch}"


def loader_start(epoch: int) -> str:
    """Where ``epoch`` is expected to start (``{"step", "epoch", "pos"}``), written by the current epoch's rank 0
    before it votes for the switch: newcomers' loaders read ahead from there while they wait for the state."""
    return f"loader-start/{epoch}"


# ---- wrapper example channel (relative to wrap_channel(epoch)) -------------------------------------------------
WRAP_MASTER = "master"
