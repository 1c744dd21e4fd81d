"""--routing-replay 1: Rollout Routing Replay. Each response token's MoE layers use, in training,
the experts the rollout chose for it, gated by the trained router's probabilities of those experts.

    torchrun --standalone --nproc_per_node=2 train_grpo.py --routing-replay 1

The engine records, per response token and MoE layer, the experts the decode forward that read it
chose (a routing hook on each MoE layer: model.MoE's `routing`, moe_switch.EPMoE's). The record
travels with the sample, through its StaleSync (scheduler_class) and a queue column, to the
trainer, whose forward takes it (Around). A prefix read again under new weights (a cut row's prefill
after the sampler's reset) routes its response tokens with their record too, so that what training
replays is what the behaviour computed with. Figures (moe/*): the response tokens with a record,
those whose experts in training differ from it (0 under replay), and those the trained router alone
would route elsewhere: like the log-prob gap, from the batch's first mini-batch, before any
optimizer step.

-1 marks a token that no forward of the call that made it read: a finished row's last token (nothing
reads it, training neither), or a cut row's last under keep=False (the next call's prefill first
reads it: its choice is recorded then, but the routes returned keep -1: training routes it freely).

    python -m pytest tests/test_routing_replay.py
"""
from contextlib import contextmanager

import torch

FIGURES = ("route_tokens", "route_mismatch", "route_free_mismatch")  # sums, over the trainers


def moe_layers(model):
    """The modules that take a routing hook (a `routing` attribute), in order."""
    return [m for m in model.modules() if hasattr(m, "routing")]


@contextmanager
def routing(model, hooks):
    """Each MoE layer's routing hook set to hooks[layer] for the duration."""
    layers = moe_layers(model)
    if hooks and len(layers) != len(hooks):
        raise ValueError(f"routes hold {len(hooks)} MoE layers, the model has {len(layers)}")
    for layer, hook in zip(layers, hooks):
        layer.routing = hook
    try:
        yield hooks
    finally:
        for layer in layers:
            layer.routing = None


# ----------------------------------------------------------------------------- the engine records
class RecordRoutes:
    """A decode forward's hook: keeps the experts each token chose, (N, K), and uses them."""

    def __init__(self):
        self.chosen = None

    def __call__(self, top_e):
        self.chosen = top_e
        return top_e


class ReplayRecorded:
    """A prefill's hook: a token with recorded experts, recorded (N, K) >= 0, uses them; a token
    with -1 (a prompt token, a pad, a token no forward has read yet) routes freely. Keeps the
    experts each token used, (N, K): the free choices fill the record."""

    def __init__(self, recorded):
        self.recorded, self.chosen = recorded, None

    def __call__(self, top_e):
        has = self.recorded[:, 0] >= 0                                               # (N,)
        self.chosen = torch.where(has[:, None], self.recorded, top_e)                # (N, K)
        return self.chosen


def sampler_class(base):
    """`base` (model.Sampler or a subclass) that records each generated token's experts, per MoE
    layer: its Generation's per_token["routes"], per row (n_i, L, K). It keeps them per seed
    (`recorded`) until the row is done: they do not depend on the weights, so reset() keeps them,
    and a continued row's prefill routes its response tokens (the last n_done) with them. A row
    starting afresh (n_done 0) drops its seed's record; a record not of the row's response is
    refused."""

    class RoutesSampler(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.recorded = {}  # seed -> (its response so far (n,), their experts (n, L, K))

        def _before_prefill(self, contexts, call, n_done, new):
            self._contexts, self._made = contexts, []  # _made: per decode forward (rows, experts)
            self._prior = self._recorded_routes(contexts, call, n_done)  # per row (T_i, L, K)
            super()._before_prefill(contexts, call, n_done, new)

        def _prefill_forward(self, tokens, positions, mask, cache, rows):
            """The bucket's recorded experts replayed; what each token used, into its record."""
            Pb = tokens.shape[1]
            L, K = self._prior[rows[0]].shape[1:]
            recorded = torch.full((len(rows), Pb, L, K), -1, dtype=torch.long)   # (b, Pb, L, K)
            for b, i in enumerate(rows):
                recorded[b, Pb - len(self._prior[i]):] = self._prior[i]
            recorded = recorded.to(tokens.device)
            hooks = [ReplayRecorded(recorded[:, :, layer].flatten(0, 1)) for layer in range(L)]
            with routing(self.model, hooks):
                logits = super()._prefill_forward(tokens, positions, mask, cache, rows)
            used = torch.stack([h.chosen for h in hooks], 1).view(recorded.shape).cpu()
            for b, i in enumerate(rows):
                self._prior[i].copy_(used[b, Pb - len(self._prior[i]):])
            return logits

        def _decode_forward(self, tok, pos, valid, cache, rows):
            hooks = [RecordRoutes() for _ in moe_layers(self.model)]
            with routing(self.model, hooks):
                logits = super()._decode_forward(tok, pos, valid, cache, rows)
            chosen = torch.stack([h.chosen for h in hooks], 1)  # (B', L, K)
            self._made.append((rows, chosen))  # rows: (B',)
            return logits

        def _after_decode(self, out, forwards, call, n_done):
            out = super()._after_decode(out, forwards, call, n_done)
            out.per_token["routes"] = self._routes_out(out.tokens)
            self._record(call, n_done, out)
            return out

        def state_dict(self):
            recorded = {s: (t.clone(), r.clone()) for s, (t, r) in self.recorded.items()}
            return super().state_dict() | {"recorded": recorded}

        def load_state_dict(self, sd):
            super().load_state_dict(sd)
            # A checkpoint without the record: its prefixes route freely when read again.
            self.recorded = {int(s): (t, r) for s, (t, r) in sd.get("recorded", {}).items()}

        def _recorded_routes(self, contexts, call, n_done):
            """Per row, (T_i, L, K): the experts its context's tokens must use if a prefill reads
            them: its seed's record at its response tokens (the last n_done), -1 elsewhere."""
            L, K = len(moe_layers(self.model)), self.model.cfg.top_k
            out = []
            for c, s, n in zip(contexts, call, n_done.tolist() if call else []):
                r = torch.full((len(c), L, K), -1, dtype=torch.long)
                if n == 0:
                    self.recorded.pop(s, None)
                elif s in self.recorded:
                    tokens, experts = self.recorded[s]
                    if not torch.equal(tokens, c[len(c) - n:].cpu()):
                        raise RuntimeError(f"Sampler: seed {s}'s recorded routes are for "
                                           f"a response of {len(tokens)} tokens "
                                           "that is not this row's "
                                           f"(its last n_done={n} tokens); "
                                           "a seed names one row from its first token to its last")
                    r[len(c) - n:] = experts
                out.append(r)
            return out

        def _routes_out(self, tokens):
            """Per row (n_i, L, K): the experts of each token this call made, -1 where no forward of
            it read the token."""
            L, K = len(moe_layers(self.model)), self.model.cfg.top_k
            out = [torch.full((len(t), L, K), -1, dtype=torch.long) for t in tokens]
            if self._made:
                rows = torch.cat([r for r, _ in self._made]).cpu()    # (M,) a row per token read
                chosen = torch.cat([c for _, c in self._made]).cpu()  # (M, L, K)
                order = rows.argsort(stable=True)                     # by row, then by step
                counts = torch.bincount(rows, minlength=len(out)).tolist()
                for o, c in zip(out, chosen[order].split(counts)):
                    o[:len(c)] = c
            return out

        def _record(self, call, n_done, out):
            """Each row's record becomes its response so far and its tokens' experts (those a
            prefill of this call first read filled in); a finished row's is dropped."""
            for i, s in enumerate(call):
                n = int(n_done[i])
                if out.done[i]:
                    self.recorded.pop(s, None)
                    continue
                context, prior = self._contexts[i], self._prior[i]
                so_far = context[len(context) - n:].cpu()  # (n,)
                tokens = torch.cat([so_far, out.tokens[i]])  # (n + n_new,)
                experts = torch.cat([prior[len(prior) - n:], out.per_token["routes"][i]])
                self.recorded[s] = (tokens, experts)  # experts: (n + n_new, L, K)

    return RoutesSampler


# ----------------------------------------------------------- the routes ride with their samples
class PerTokenFields:
    """What scheduler_class keeps, RoutesSampler's: the sampler's per-token outputs, its
    Generation's per_token (name -> R sequences of one entry per new token, each token's experts
    (n, L, K)), kept with each sample across the chunks of a partial rollout, saved with the
    samples in flight (StaleSync.state_dict), and handed on in Batch.per_token. A field must
    come with every call."""

    def keep(self, samples, out, tokens):
        """decode(): each of this call's R rows' entries, kept with its sample."""
        fields = _per_token(out, tokens)
        for r, s in enumerate(samples):
            for name, values in fields.items():
                s.setdefault("per_token", {}).setdefault(name, []).append(values[r])

    def batch(self, samples):
        """Batch.per_token: name -> (B,) of (n_i, ...), each sample's pieces joined."""
        return {name: [_joined(s, name) for s in samples] for name in self.names(samples)}

    def names(self, samples):
        """The per-token fields these samples hold. Refuses a sample whose field misses some of its
        tokens (returned on some calls only, or a checkpoint saved without it)."""
        names = list(dict.fromkeys(n for s in samples for n in s.get("per_token", {})))
        for s in samples:
            for name in names:
                n = sum(len(piece) for piece in s.get("per_token", {}).get(name, []))
                if n != len(s["tokens"]):
                    raise ValueError(f"sample {s['id']}: per_token[{name!r}] holds {n} entries "
                                     f"for its {len(s['tokens'])} tokens; the sampler must return "
                                     "the field on every call (a checkpoint saved without it "
                                     "cannot continue samples that need it)")
        return names

    def save(self, s):
        """A sample's fields for its checkpoint: each joined, (n_i, ...)."""
        return {n: _joined(s, n) for n in s.get("per_token", {})}

    def load(self, saved):
        """A saved sample's fields, one piece each (older checkpoints: none)."""
        return {n: [v] for n, v in saved.get("per_token", {}).items()}


def _per_token(out, tokens):
    """The per-token fields of one call: name -> R tensors, one entry per new token."""
    fields = {name: [torch.as_tensor(v) for v in rows]
              for name, rows in (getattr(out, "per_token", None) or {}).items()}
    for name, rows in fields.items():
        bad = [i for i, (v, t) in enumerate(zip(rows, tokens)) if len(v) != len(t)]
        bad = bad if len(rows) == len(tokens) else [-1]
        if bad:
            raise ValueError(f"per_token[{name!r}]: rows {bad[:8]} do not hold one entry per new "
                             f"token ({len(rows)} rows for {len(tokens)})")
    return fields


def _joined(s, name):
    """A sample's per-token field, its calls' pieces joined: (n_i, ...); no piece: (0,)."""
    pieces = s.get("per_token", {}).get(name, [])
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def scheduler_class(base):
    """`base` (stalesync.StaleSync or a subclass) that keeps the sampler's per-token outputs with
    their samples (PerTokenFields), as train_grpo.build_rollout takes it: across the chunks of a
    partial rollout, in its state_dict, and in each Batch.per_token."""

    class PerTokenSync(base):
        fields = PerTokenFields()

        def _keep_per_token(self, samples, out, tokens):
            self.fields.keep(samples, out, tokens)

        def _per_token(self, groups):
            return self.fields.batch([s for g in groups for s in g["samples"]])

        def state_dict(self):
            samples = [s for g in self.pool for s in g["samples"]]
            self.fields.names(samples)  # each covers its tokens
            sd = super().state_dict()
            for saved, s in zip([t for g in sd["pool"] for t in g["samples"]], samples):
                saved["per_token"] = self.fields.save(s)
            return sd

        def load_state_dict(self, sd):
            saved = [s for g in sd["pool"] for s in g["samples"]]
            pieces = [self.fields.load(s) for s in saved]
            self.fields.names([dict(s, per_token=p) for s, p in zip(saved, pieces)])  # all or none
            super().load_state_dict(sd)
            for s, p in zip([s for g in self.pool for s in g["samples"]], pieces):
                s["per_token"] = p

    return PerTokenSync


# ----------------------------------------------------------------------------- training replays
def pad_routes(prompts, routes, T):
    """(b, T-1, L, K): at each position of a forward over tokens[:, :-1], the experts the rollout
    chose for the token read there (response token j sits at P_i + j), -1 elsewhere: prompt tokens
    route freely."""
    L, K = routes[0].shape[1:] if routes else (0, 0)
    out = torch.full((len(prompts), T - 1, L, K), -1, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, routes)):
        n = min(len(r), T - 1 - len(p))  # the last response token is read by no trained forward
        out[b, len(p):len(p) + n] = r[:n]
    return out


class ReplayRoutes:
    """A training forward's hook. recorded (N, K): the engine's experts for each token, -1 where it
    recorded none (a prompt token routes freely). The router's own choice is compared with the
    record (free_mismatch (N,): the top-k sets differ); with replay=True a recorded token uses its
    recorded experts, and `mismatch`, the experts used against the record, is 0 by construction."""

    def __init__(self, recorded, replay):
        self.recorded, self.replay, self.mismatch, self.free_mismatch = recorded, replay, None, None

    def __call__(self, top_e):
        has = self.recorded[:, 0] >= 0                                               # (N,)
        used = torch.where(has[:, None], self.recorded, top_e) if self.replay else top_e
        self.free_mismatch = has & _differ(top_e, self.recorded)                     # (N,)
        self.mismatch = has & _differ(used, self.recorded)                           # (N,)
        return used


def _differ(a, b):
    """(N,): rows of two (N, K) expert choices that are different sets."""
    return (a.sort(-1).values != b.sort(-1).values).any(-1)


class Around:
    """grpo's context around a forward over some rows of the samples (Samples.around): a
    ReplayRoutes hook on each MoE layer, the rows' recorded experts replayed (replay=False: only
    compared). Given `mask` (the first mini-batch's response positions), it adds to `sums`."""

    def __init__(self, replay=True):
        self.replay = replay

    @contextmanager
    def __call__(self, model, samples, rows, T, mask=None, sums=None):
        L, K = len(moe_layers(model)), model.cfg.top_k
        per_token = samples.per_token["routes"]
        recorded = [per_token[i].long().view(-1, L, K) for i in rows]   # b x (n_i, L, K)
        routes = pad_routes([samples.prompts[i] for i in rows], recorded, T)  # (b, T-1, L, K)
        routes = routes.to(next(model.parameters()).device)
        flat = routes.flatten(0, 1)                                           # (b (T-1), L, K)
        hooks = [ReplayRoutes(flat[:, i], self.replay) for i in range(routes.shape[2])]
        with routing(model, hooks):
            yield hooks
        if sums is None:
            return
        for key in FIGURES:  # every rank holds every key: the sums are one collective
            sums.setdefault(key, 0.0)
        if mask is not None:
            has = (routes[..., 0, 0] >= 0) & mask                                     # (b, T-1)
            pairs = (("route_mismatch", "mismatch"), ("route_free_mismatch", "free_mismatch"))
            for key, attr in pairs:
                differ = torch.stack([getattr(h, attr) for h in hooks]).any(0).view_as(has)
                sums[key] += float((differ & has).sum())
            sums["route_tokens"] += float(has.sum())


def means(sums):
    """The figures' means over the trainers' sums: response tokens whose experts differ, in some
    layer, from the rollout's: those the training forward used (0 under replay), and its router's
    own choice (what replay overrides), over the response tokens with a recorded route."""
    tokens = max(sums["route_tokens"], 1.0)
    return {"moe/routing_mismatch": sums["route_mismatch"] / tokens,
            "moe/router_mismatch_free": sums["route_free_mismatch"] / tokens,
            "moe/routed_tokens": sums["route_tokens"]}


def apply(run):
    """The trainers replay the recorded experts and the log reports moe/* (the run's sampler records
    them, as train_grpo.build_rollout takes sampler_class; a per-token queue column carries
    them)."""
    run.around = Around(replay=True)
    run.log.means.append(means)


def rollout_classes(sampler, scheduler):
    """The run's sampler and scheduler classes, each generated token's experts recorded and kept
    with its sample until the batch that trains it."""
    return sampler_class(sampler), scheduler_class(scheduler)
