"""--deploy hybrid's auxiliary ranks: the queue stage between the actor's rollout and its update.

    python -m pytest tests/test_train_grpo.py -k hybrid

Each auxiliary rank (aux_loop) takes its share of the groups as the actor puts them, whole groups,
round robin by their place in their writer's puts, and adds their columns (hybrid.aux_added: the
reference's log-probs; a reward model's rewards and advantages) in pieces of a micro-batch's groups.
Where dynamic sampling or the curriculum judges each group as it completes, the reward model scores
it then instead, at the actor's request. While no trainer reads its columns it does not poll: it
blocks in the store on its inbox (options/push.Inbox), where the actor posts a notice for each
event it must act on:
  group         a group was put for it: read what there is;
  open, close   a trainer is reading its columns: serve the queue (and look for its own groups)
                until every read has closed;
  save:<step>   a checkpoint: no read of its own is half done, so it joins the save (a group
                put but not yet read stays in the actor's saved rows, read after the save);
  score:<key>   an actor rank asks the reward model's rewards of a group (its filter and curriculum
                judge each group as it completes): answered under <key>/out;
  final         trainer 0 has read the last batch: the run is over;
  lost          its watchdog found a peer gone (options/liveness.py): raise, naming it.
"""
import json
import time
from dataclasses import replace

import torch

import grpo
from options.liveness import PeerLost
from options.push import Inbox, wait_for
from plumbing import checkpoint


def final_key(run):
    return f"w:{run.key}/final"


def aux_done_key(run, rank):
    return f"w:{run.key}/aux_done/{rank}"


def inbox_key(run, rank):
    return f"w:{run.key}/inbox/{rank}"


def ready_key(run, step, rank):
    return f"w:{run.key}/aux_ready/{step}/{rank}"


def notify(run, ranks, notice):
    """Post `notice` to each auxiliary rank's inbox: "group" (one is put for it), "open" and
    "close" (a trainer's read of its columns), "save:<step>" (a checkpoint), "final" (the end)."""
    for r in ranks:
        Inbox(run.store, inbox_key(run, r)).post(notice)


def aux_loop(run):
    """An auxiliary rank: the queue stage between rollout and training. It takes its share of the
    groups as the actor puts them, whole groups, and adds their columns (aux_columns) in pieces of a
    micro-batch's groups, the earliest put first; each put serves the queue, so that a trainer waits
    on this rank for at most a piece. Runs until trainer 0 says the last batch has been read."""
    seen, done = run.aux_seen, run.aux_done  # what a checkpoint keeps of this loop
    for w in run.roles.writers():
        seen.setdefault(w, 0)
    piece = aux_piece(run)                        # rows per piece of work
    while True:
        pending = aux_groups(run, seen, done)
        cpu = time.process_time()
        with run.spans("idle"):
            kind, rows = wait_for_groups(run, pending)
        run.idle["cpu_s"] += time.process_time() - cpu  # what waiting costs this rank's CPU
        if kind == "end":  # the run is over: every batch it trains has been read
            break
        if kind == "save":  # no read half done: ready, then saved
            run.store.set(ready_key(run, rows, run.rank), "1")
            checkpoint.save(run, rows)
            continue
        got = set(rows.ids)
        groups = [g for g in sorted(pending, key=lambda g: g[::-1]) if set(pending[g]) <= got]
        ids = [r for g in groups for r in pending[g]]  # group by group, in put order
        if len(ids) != len(rows.ids):  # a put publishes a whole group: a part of one is a bug
            raise RuntimeError(f"rank {run.rank}: read rows {sorted(set(rows.ids) - set(ids))} "
                               "without the rest of their group")
        for j in range(0, len(ids), piece):
            aux_columns(run, rows, ids[j:j + piece])
        done.update(groups)
        for w in seen:
            while (w, seen[w]) in done:
                done.discard((w, seen[w]))
                seen[w] += 1
    run.queue.serve()  # retire the transfers the trainers acknowledged
    run.store.set(aux_done_key(run, run.rank), json.dumps(run.idle))


def aux_piece(run):
    """Rows per piece of an auxiliary rank's work: its share of one micro-batch, in whole groups."""
    cfg = run.cfg
    micro_batches = cfg.micro_batches * cfg.updates_per_batch * len(run.roles.auxiliaries)
    return max(1, cfg.prompts_per_step // micro_batches) * cfg.group_size


def aux_columns(run, rows, ids):
    """4 (and 2-3 with a reward model no rule asks as groups complete): the frozen reference's
    log-probs of rows `ids` (whole groups, in order; one forward), and the reward model's rewards
    and group advantages, put back as columns of the same rows."""
    cfg, added = run.cfg, run.queue.spec.stages["from_aux"]
    run.spans.args = {"rows": len(ids)}
    where = {r: i for i, r in enumerate(rows.ids)}  # the queue returns ids ascending
    prompts, responses = ([rows.cols[c][where[r]] for r in ids] for c in ("prompt", "response"))
    samples, columns = grpo.Samples(prompts, responses, None, None), {}
    if "ref_logprobs" in added:  # the KL term on
        with run.spans("reference"), run.reference.on_device() as ref:
            columns["ref_logprobs"] = grpo.chunk_logprobs(
                ref, samples, replace(run.algo, micro_batches=1), run.device)
        run.queue.serve()  # between the two models: a trainer may wait for columns put before
    if "reward" in added:
        rewards = run.score(prompts, responses)  # (B,)
        advantages = grpo.group_advantages(rewards, cfg.group_size, cfg.adv_estimator)
        columns |= {"reward": rewards.tolist(), "advantage": advantages.tolist()}
    run.queue.put(columns, ids=ids)


def aux_groups(run, seen, done):
    """This rank's next groups of each writer, (writer, k) -> the G row ids of its k-th, not yet
    done: (S + 1) batches' share of a replica, the most StaleSync lets it complete ahead of
    training. Counted in this rank's own groups, the window spans aux_ranks times that many of
    the writer's groups: wider than needed, which costs nothing, as a read takes those put.
    Round robin: the m-th group a writer puts goes to auxiliary rank
    (m + the writer's index) % aux_ranks. None without the KL term ({}): no reference to compute."""
    cfg, G, aux = run.cfg, run.cfg.group_size, run.roles.auxiliaries
    if "aux" not in run.queue.spec.stages:
        return {}
    ahead = (cfg.staleness + 1) * cfg.prompts_per_step // run.roles.replicas
    out = {}
    for i, (w, k0) in enumerate(seen.items()):
        first = (aux.index(run.rank) - i) % len(aux)  # this rank's first m of writer w
        for k in range(k0, k0 + ahead):
            m = first + k * len(aux)
            if (w, k) not in done:
                out[(w, k)] = [run.queue.row_id(m * G + j, w) for j in range(G)]
    return out


def wait_for_groups(run, groups):
    """("rows", the rows of whichever of `groups` ((writer, k) -> row ids) the actor has put),
    once there is one; ("save", step) when the actor asks for a checkpoint; ("end", None) once
    trainer 0 has said the run is over. With no trainer reading this rank's columns it blocks on
    its inbox, not polling: the next notice wakes it. While one is (run.readers, from "open" and
    "close"), it serves the queue and polls, its own groups too: a group published late (another
    writer's put not yet written before it in the queue's log) is found then. An actor that puts
    nothing for pg_timeout_s times out, naming the groups waited for; so does a read that never
    closes."""
    only = {r for ids in groups.values() for r in ids}
    deadline = time.monotonic() + run.cfg.pg_timeout_s
    while not run.store.check([final_key(run)]):
        if only:  # (none without the KL term: this rank only scores)
            rows = run.queue.get("aux", len(only), min_rows=0, only=only)  # what there is
            run.idle["gets"] += 1
            if rows.ids:
                return "rows", rows
        notice = run.inbox.take(0 if run.readers else deadline - time.monotonic())
        if notice is None and run.readers and time.monotonic() < deadline:
            time.sleep(run.queue.spec.poll_s)
            continue
        if notice is None:
            still = f" ({run.readers} reads of its columns still open)" if run.readers else ""
            raise TimeoutError(f"rank {run.rank}: the actor put none of groups "
                               f"{sorted(groups)[:8]} (writer, index) in "
                               f"{run.cfg.pg_timeout_s}s{still}: is the actor alive?")
        if notice == "lost":
            raise PeerLost(run.watchdog.error)
        if notice.startswith("score:"):
            answer_score(run, notice.split(":", 1)[1])
            deadline = time.monotonic() + run.cfg.pg_timeout_s  # the actor is alive
            continue
        if notice.startswith("save:"):  # asked once every trainer's reads are closed
            if run.readers:
                raise RuntimeError(f"rank {run.rank}: a checkpoint was asked for during a read")
            return "save", int(notice.split(":")[1])
        run.readers += {"open": 1, "close": -1}.get(notice, 0)  # "group", "final": the loop
        if notice == "close":
            run.queue.serve()  # retire the transfer the reader acknowledged
    return "end", None


class RemoteScore:
    """The actor's run.score where the reward model lives on the auxiliary ranks: each group's
    rewards asked of one of them through the store (a "score:<key>" notice in its inbox), the
    queue served while it answers. The filter and the curriculum ask as each group completes
    (observe_group), the put asks again: the verdict is kept for it, so each group is scored once,
    as a batch of its own, as colocated-all scores it."""

    def __init__(self, run, keep=256):
        self.run, self.asked, self.kept, self.keep = run, 0, {}, keep

    def __call__(self, prompts, responses):  # (G,) rewards, float32
        rows = (tuple(prompts[0].tolist()), tuple(tuple(r.tolist()) for r in responses))
        if rows in self.kept:
            return self.kept.pop(rows)
        run, aux = self.run, self.run.roles.auxiliaries
        key = f"w:{run.key}/score/{run.rank}/{self.asked}"
        helper = aux[(run.rank + self.asked) % len(aux)]
        self.asked += 1
        asked = [[p.tolist() for p in prompts], [r.tolist() for r in responses]]
        run.store.set(key, json.dumps(asked))
        notify(run, [helper], f"score:{key}")
        wait_for(run, [f"{key}/out"], f"the reward model's rewards of a group from rank {helper}")
        rewards = torch.tensor(json.loads(run.store.get(f"{key}/out")), dtype=torch.float32)
        run.store.delete_key(f"{key}/out")
        self.kept[rows] = rewards
        while len(self.kept) > self.keep:  # the verdicts of groups the filter dropped
            self.kept.pop(next(iter(self.kept)))
        return rewards


def answer_score(run, key):
    """An actor rank's request under `key`: the reward model's rewards of one group, scored as a
    batch of its own (run.score: options/learned_reward.py), put back under key/out."""
    prompts, responses = json.loads(run.store.get(key))
    rewards = run.score([torch.tensor(p) for p in prompts], [torch.tensor(r) for r in responses])
    run.store.delete_key(key)
    run.store.set(f"{key}/out", json.dumps(rewards.tolist()))
