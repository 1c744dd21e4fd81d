"""StaleSync's checkpoint state (stalesync.py): a scheduler saved mid-run, its partial rollouts in
flight, and loaded again so that the run continues bit for bit. plumbing/checkpoint.py calls it.

    state_dict(sched) -> dict   the groups in flight, the slots to reopen, the counters, the fates
    load_state_dict(sched, sd)  the same scheduler again (its config must match, the brakes aside)
    start_at(sched, version)    empty, at `version` (a resume at another world size)

Copy it with stalesync.py to resume a run: torch only.

    python -m pytest tests/test_stale_state.py
"""
import torch

COUNTERS = ("version", "batches_out", "slots_opened", "next_id", "regenerated", "filtered",
            "filtered_reported", "filtered_at_take", "max_admitted_over")


def state_dict(sched):
    """The groups in flight (their samples' lists as tensors), the slots to reopen, the counters
    (COUNTERS), the fates, the sampler's state, and the samples' per-token fields (the fields
    object's, sched.fields). Not prompt_fn's or seed_fn's: a function of (slot, attempt) alone, or
    of state the caller restores, resumes exactly; one that reads an unsaved stream serves it
    again."""
    fields = sched.fields
    if fields is not None:
        fields.names([s for g in sched.pool for s in g["samples"]])  # each covers its tokens

    def saved(s):  # a sample, its lists as tensors
        return dict(s, tokens=torch.tensor(s["tokens"], dtype=torch.long),
                    logprobs=torch.tensor(s["logprobs"], dtype=torch.float32),
                    versions=torch.tensor(s["versions"], dtype=torch.long),
                    per_token=fields.save(s) if fields is not None else {})
    pool = [dict(g, prompt=g["prompt"].clone(), samples=[saved(s) for s in g["samples"]])
            for g in sched.pool]
    sampler = sched.sampler_state.state_dict() if sched.sampler_state is not None else None
    return dict(cfg=vars(sched.cfg).copy(), **{k: getattr(sched, k) for k in COUNTERS},
                reopen=[list(r) for r in sched.reopen], fate=dict(sched.fate), pool=pool,
                sampler=sampler)


def load_state_dict(sched, sd):
    """state_dict's dict into `sched`; refuses another config (the brakes aside)."""
    brakes = ("max_len", "max_filtered")  # they bound a run, not its state: free to change
    saved, mine = ({k: v for k, v in c.items() if k not in brakes}
                   for c in (sd["cfg"], vars(sched.cfg)))
    if saved != mine:
        raise ValueError(f"checkpoint config {saved} differs from this scheduler's {mine}")
    fields = sched.fields

    def loaded(s):  # a saved sample, its tensors as lists (older checkpoints: no per_token)
        out = dict(s, tokens=s["tokens"].tolist(), logprobs=s["logprobs"].tolist(),
                   versions=s["versions"].tolist())
        out.pop("per_token", None)
        if fields is not None:
            out["per_token"] = fields.load(s)
        return out
    pool = [dict(g, prompt=g["prompt"].clone(), samples=[loaded(s) for s in g["samples"]])
            for g in sd["pool"]]
    if fields is not None:
        fields.names([s for g in pool for s in g["samples"]])  # a field some samples lack
    for key in COUNTERS:  # older checkpoints have no filtered_at_take
        fallback = sd["filtered_reported"] if key == "filtered_at_take" else sd[key]
        setattr(sched, key, sd.get(key, fallback))
    if sd["sampler"] is not None:  # the held rows' KV cache too, if it saves it: bit-exact
        sched.sampler_state.load_state_dict(sd["sampler"])
    elif sched.reset_fn is not None:  # a cache not checkpointed: the prefixes are read again
        sched.reset_fn()
    sched.reopen = [tuple(r) for r in sd["reopen"]]
    sched.fate = dict(sd["fate"])
    sched.pool = pool


def start_at(sched, version):
    """Empty, at `version` with as many batches out, on a scheduler that has done nothing yet: a
    resume that cannot keep the groups in flight (another world size) opens the next slots again,
    their first attempts."""
    if sched.batches_out or sched.pool:
        raise RuntimeError("start_at() on a scheduler that has already emitted or admitted "
                           "groups")
    sched.version = sched.batches_out = version
    sched.slots_opened = version * sched.cfg.groups_per_step
