"""A deterministic stand-in for predictor.engine.Predictor, for service tests (not a model)."""
from __future__ import annotations

import math


class FakePredictor:
    """compute_s grows with the per-GPU batch; comm_s with log2(gpus) and with the node count.

    Counts its calls so tests can check caching and that requests never fit.
    """

    fits = 0
    predict_calls = 0

    def __init__(self, compute_per_sample_s: float = 0.0005, comm_per_doubling_s: float = 0.004,
                 inter_node_s: float = 0.01, fail: bool = False):
        self.compute_per_sample_s = compute_per_sample_s
        self.comm_per_doubling_s = comm_per_doubling_s
        self.inter_node_s = inter_node_s
        self.fail = fail

    def fit(self, profiles, observations):
        if self.fail:
            raise RuntimeError("fit exploded")
        FakePredictor.fits += 1
        self.profiles_ = dict(profiles)
        self.known_ = {(o["profile"], o["gpu"]) for o in observations if o["kind"] == "step"}
        self.n_observations_ = len(observations)
        self.links_ = sorted({o["link"] for o in observations if o["kind"] == "collective"})
        return self

    def known(self, profile_name, gpu):
        return (profile_name, gpu) in self.known_

    def to_params(self):
        return {"known": sorted(self.known_), "n_observations": self.n_observations_, "links": self.links_,
                "settings": [self.compute_per_sample_s, self.comm_per_doubling_s, self.inter_node_s]}

    def load_params(self, doc, profiles):
        self.known_ = {tuple(k) for k in doc["known"]}
        self.n_observations_, self.links_ = doc["n_observations"], doc["links"]
        self.compute_per_sample_s, self.comm_per_doubling_s, self.inter_node_s = doc["settings"]
        self.profiles_ = dict(profiles)
        return self

    def link_stats(self):
        return [{"link": link, "observations": self.n_observations_} for link in self.links_]

    def predict(self, profile, gpu, per_gpu_batch, candidates, job_id=None, uid=None):
        FakePredictor.predict_calls += 1
        out = []
        for cand in candidates:
            gpus, nodes = sum(cand["layout"]), len(cand["layout"])
            compute = self.compute_per_sample_s * per_gpu_batch
            comm = 0.0 if gpus == 1 else self.comm_per_doubling_s * math.log2(gpus) + self.inter_node_s * (nodes - 1)
            iter_s = compute + comm
            out.append({"layout": cand["layout"], "samples_per_s": gpus * per_gpu_batch / iter_s, "iter_s": iter_s,
                        "compute_s": compute, "comm_s": comm, "uncertainty": 0.1,
                        "basis": "fake" if job_id is None else f"measured by job {job_id}"})
        return out


PROFILE = {"name": "resnet50", "tensors": [{"name": "fc.weight", "numel": 2048000, "dtype": "float32"},
                                           {"name": "conv1.weight", "numel": 9408, "dtype": "float32"}]}
STEP = {"kind": "step", "profile": "resnet50", "gpu": "H200", "layout": [2, 2], "intra_link": "nvlink",
        "inter_link": "ib", "per_gpu_batch": 64, "iter_s": 0.0322}
COLLECTIVE = {"kind": "collective", "op": "allreduce", "link": "nvlink", "world": 4, "bytes": 67108864,
              "seconds": 0.00037, "gpu": "H200"}
DDP_OVERHEAD = {"kind": "ddp_overhead", "gpu": "H200", "world": 2, "probe": "many-small", "buckets": 2,
                "tensors": 400, "plain_s": 0.0101, "ddp_s": 0.0183, "extra_s": 0.0082}


class ModelsOverFake:
    """The slice of the service's model holder the planner uses, over FakePredictor with PROFILE registered;
    subclasses give `known(name, gpu)` and `predict(profile, gpu, batch, candidates, job_id=None)`."""

    version = "g1"

    def __init__(self) -> None:
        from predictor.profiles import Profile
        self.fake = FakePredictor().fit({}, [])
        self.profiles = {"resnet50": Profile.from_dict(PROFILE)}

    def predictor(self):
        return self.fake

    def profile(self, name):
        return self.profiles.get(name)


class FittedModels:
    """The slice of service.ModelCache the planner uses, over a real fitted engine Predictor (no service)."""

    version = "v1"

    def __init__(self, predictor, profiles: dict):
        self.p, self.profiles = predictor, profiles

    def predictor(self):
        return self.p

    def profile(self, name):
        return self.profiles.get(name)

    def known(self, name, gpu):
        return self.p.known(name, gpu)

    def predict(self, profile, gpu, batch, candidates, job_id=None, uid=None):
        return self.p.predict(profile, gpu, batch, candidates, job_id=job_id)


def seeded_app(tmp_path, wait=None, **config):
    """A service app over FakePredictor, refitting at once, with PROFILE and [STEP, COLLECTIVE] posted and a model
    fitted on them (waiting at most `wait`, default 10 s); `config`: further Config fields."""
    from datetime import timedelta

    from predictor.app import create_app
    from predictor.config import Config
    app = create_app(Config(db_path=str(tmp_path / "p.db"), refit_debounce=timedelta(0),
                            refit_min_interval=timedelta(0), refit_poll=timedelta(milliseconds=50), **config),
                     predictor_factory=FakePredictor)
    client = app.test_client()
    assert client.post("/v1/profiles", json=PROFILE).status_code == 201
    assert client.post("/v1/observations", json=[STEP, COLLECTIVE]).status_code == 201
    assert app.extensions["elastic_predictor"].models.wait_fresh(wait or timedelta(seconds=10))
    return app
