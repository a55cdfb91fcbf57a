"""Worker selection: earliest expected finish, newcomer handling, bans with backoff, credits, blame."""

from agora.node.trainer.routing import MIN_CREDITS, Roster, WorkerView, pick_worker, producer_of_refused


def _view(peer, stage=0, **fields):
    fields.setdefault("granted_credits", 16)  # room enough that credits do not decide (their own tests below)
    return WorkerView(peer_id=peer, endpoint=f"127.0.0.1:{1000 + len(peer)}", stage=stage, **fields)



def test_a_stage_lists_what_the_last_refresh_and_exclusions_say():
    """`of_stage` keeps the workers indexed by stage between changes: a refresh that moves a worker to
    another stage, adds or drops one, or an exclusion, shows at once."""
    roster = Roster(microbatch_size=2)
    roster.refresh([_view("a", 0), _view("b", 0), _view("c", 1)])
    assert [v.peer_id for v in roster.of_stage(0)] == ["a", "b"] and [v.peer_id for v in roster.of_stage(1)] == ["c"]
    listed = roster.of_stage(0)
    listed.clear()  # the caller's own list
    assert len(roster.of_stage(0)) == 2
    roster.refresh([_view("a", 0), _view("b", 1), _view("c", 1), _view("d", 2)])  # b moved, d joined
    assert [v.peer_id for v in roster.of_stage(0)] == ["a"] and [v.peer_id for v in roster.of_stage(1)] == ["b", "c"]
    assert [v.peer_id for v in roster.of_stage(2)] == ["d"]
    roster.exclude("c")
    assert [v.peer_id for v in roster.of_stage(1)] == ["b"] and roster.of_stage(3) == []
    roster.refresh([_view("b", 1)])  # the rest left
    assert roster.of_stage(0) == [] and [v.peer_id for v in roster.of_stage(1)] == ["b"]

def test_faster_worker_wins_until_its_queue_grows():
    fast = _view("fast", announced_samples_per_s=40.0)
    slow = _view("slow", announced_samples_per_s=10.0)
    assert pick_worker([fast, slow], now=0, microbatch_size=4).peer_id == "fast"
    fast.announced_queue = 5  # 6 * 0.1 s > 1 * 0.4 s
    assert pick_worker([fast, slow], now=0, microbatch_size=4).peer_id == "slow"


def test_measured_time_beats_announced_throughput():
    a = _view("a", announced_samples_per_s=100.0, measured_seconds=2.0)
    b = _view("b", announced_samples_per_s=1.0, measured_seconds=0.5)
    assert pick_worker([a, b], now=0, microbatch_size=4).peer_id == "b"


def test_newcomer_gets_traffic_behind_a_penalty():
    known = _view("known", measured_seconds=1.0)
    newcomer = _view("new")
    assert pick_worker([known, newcomer], 0, 4).peer_id == "known"
    known.in_flight = 1  # 2 * 1.0 > 1.5
    assert pick_worker([known, newcomer], 0, 4).peer_id == "new"


def test_only_routable_phases_and_unbanned_peers():
    syncing = _view("sync", phase="weight_sync", measured_seconds=0.1)
    banned = _view("banned", measured_seconds=0.1, banned_until=10.0)
    member = _view("member", measured_seconds=5.0)
    assert pick_worker([syncing, banned, member], now=5.0, microbatch_size=1).peer_id == "member"
    assert pick_worker([syncing, banned, member], now=11.0, microbatch_size=1).peer_id == "banned"
    assert pick_worker([syncing, banned], now=5.0, microbatch_size=1) is None
    assert pick_worker([member], 0, 1, exclude=frozenset({"member"})) is None


def test_failures_ban_with_exponential_backoff_and_success_resets():
    roster = Roster(microbatch_size=2, ban_base_s=1.0, ban_max_s=5.0)
    roster.refresh([_view("a"), _view("b")])
    assert [roster.failed("a", now=0) for _ in range(4)] == [1.0, 2.0, 4.0, 5.0]
    assert roster.choose(0, now=1.0).peer_id == "b"
    roster.started("a")
    roster.succeeded("a", 0.3)
    assert roster.workers["a"].failures == 0 and roster.workers["a"].measured_seconds == 0.3


def test_a_blamed_worker_is_banned_like_a_failed_one_without_a_call_to_release():
    """Its call had returned: the ban and the failure count of `failed`, and no other call of it forgotten."""
    roster = Roster(microbatch_size=2, ban_base_s=1.0, ban_max_s=5.0)
    roster.refresh([_view("a"), _view("b")])
    roster.started("a")
    assert [roster.blamed("a", now=0) for _ in range(3)] == [1.0, 2.0, 4.0]
    a = roster.workers["a"]
    assert (a.failures, a.banned_until, a.in_flight) == (3, 4.0, 1)
    assert roster.choose(0, now=1.0).peer_id == "b" and roster.blamed("gone", now=0) == 0.0


def test_an_excluded_worker_is_never_routed_counted_or_listed_again_whatever_its_record_says():
    roster = Roster(microbatch_size=4)
    roster.refresh([WorkerView("a", "h:1", 0, announced_samples_per_s=50.0),
                    WorkerView("b", "h:2", 0, announced_samples_per_s=100.0)])
    assert roster.choose(0, now=0.0).peer_id == "b" and roster.replicas(0) == 2
    roster.exclude("b")
    roster.refresh([WorkerView("a", "h:1", 0, announced_samples_per_s=50.0),
                    WorkerView("b", "h:3", 0, announced_samples_per_s=1000.0)])  # a new address, a fresh record
    assert [v.peer_id for v in roster.of_stage(0)] == ["a"] and roster.replicas(0) == 1
    assert roster.choose(0, now=1e9).peer_id == "a"


def test_a_refused_frame_is_the_producer_s_only_when_the_call_carried_it_from_another_worker():
    """A Forward's wire comes from the stage before, a Backward's output gradient from the stage after;
    a claim about a frame the call did not carry (a head's wire, a Forward's output_grad) names none."""
    assert producer_of_refused(3, 1, backward=False, field="wire") == 0
    assert producer_of_refused(3, 2, backward=False, field="wire") == 1
    assert producer_of_refused(3, 0, backward=True, field="output_grad") == 1
    assert producer_of_refused(3, 1, backward=True, field="output_grad") == 2
    assert producer_of_refused(1, 0, backward=False, field="wire") is None  # the head: no wire
    assert producer_of_refused(3, 1, backward=False, field="output_grad") is None
    assert producer_of_refused(3, 1, backward=True, field="wire") is None
    assert producer_of_refused(2, 1, backward=True, field="output_grad") is None  # nothing after the tail
    assert producer_of_refused(3, 1, backward=False, field="tokens") is None


def test_a_busy_answer_is_back_pressure_never_a_failure():
    roster = Roster(microbatch_size=2)
    roster.refresh([_view("a", granted_credits=4), _view("b", granted_credits=4)])
    for _ in range(3):
        roster.started("a")
    roster.busy("a", now=0.0, pushback_s=0.2)  # 2 of its calls are still there: wait for them, no pause
    a = roster.workers["a"]
    assert (a.failures, a.banned_until, a.paused_until, a.in_flight, a.credits) == (0, 0.0, 0.0, 2, 2)
    assert not a.has_credit(0.0) and roster.held_back(0, now=0.0)
    assert roster.choose(0, now=0.0).peer_id == "b"  # the rest goes to the stage's other replica
    roster.started("b")
    roster.busy("b", now=0.0, pushback_s=0.2)  # none of ours there: paused for the worker's pushback
    b = roster.workers["b"]
    assert (b.failures, b.banned_until, b.paused_until, b.in_flight) == (0, 0.0, 0.2, 0)
    assert roster.choose(0, now=0.1) is None and roster.held_back(0, now=0.1)
    assert roster.next_pause_end(0, now=0.1) == 0.2 and roster.choose(0, now=0.2).peer_id == "b"
    roster.busy("b", now=0.0, pushback_s=None)  # a busy answer without a pushback: a short pause
    assert 0 < roster.workers["b"].paused_until - 0.0 <= 1.0
    roster.busy("b", now=0.0, pushback_s=3600.0)  # a pushback is a hint, never a ban
    assert roster.workers["b"].paused_until <= 1.0


def test_credits_bound_the_calls_outstanding_and_replies_refresh_them():
    roster = Roster(microbatch_size=2)
    roster.refresh([WorkerView("a", "127.0.0.1:1", 0, announced_credits=3, announced_in_flight_credits=12),
                    WorkerView("b", "127.0.0.1:2", 0)])
    a, b = roster.workers["a"], roster.workers["b"]
    assert (a.credits, a.in_flight_credits, b.credits, b.in_flight_credits) == (3, 12, MIN_CREDITS, 0)
    for _ in range(3):
        roster.started("a")
    assert not a.has_credit(0.0) and a.in_flight == 3
    roster.succeeded("a", 0.05, compute_s=0.01, queued_s=0.02, credits=5, in_flight_credits=7)
    assert (a.credits, a.in_flight_credits, a.in_flight) == (5, 7, 2) and a.has_credit(0.0)
    assert abs(a.round_trip_s - 0.02) < 1e-12  # the call's time outside the worker's compute and queue
    roster.succeeded("a", 0.05, credits=0)  # a reply that states none keeps the last grant
    assert a.credits == 5
    # A later record keeps what the worker granted this trainer itself.
    roster.refresh([WorkerView("a", "127.0.0.1:1", 0, announced_credits=1), WorkerView("b", "127.0.0.1:2", 0)])
    assert roster.workers["a"].credits == 5


def test_in_flight_cap_is_the_tightest_stage_over_its_replicas():
    roster = Roster(microbatch_size=1)
    roster.refresh([WorkerView("h1", "h:1", 0, announced_in_flight_credits=10),
                    WorkerView("h2", "h:2", 0, announced_in_flight_credits=6),
                    WorkerView("b", "b:1", 1, announced_in_flight_credits=12),
                    WorkerView("syncing", "b:2", 1, phase="weight_sync", announced_in_flight_credits=50),
                    WorkerView("t", "t:1", 2)])  # the tail keeps no stash: no bound from it
    assert roster.in_flight_cap(3) == 12
    assert roster.credits_of_stage(0) == 2 * MIN_CREDITS
    roster.refresh([WorkerView("t", "t:1", 2)])
    assert roster.in_flight_cap(3) is None


def test_a_stage_s_share_is_its_replicas_over_the_callers_each_serves():
    """What the trainer's depth is sized to fill (node/trainer/inflight.py): each replica sharing the
    work counts 1 / the callers its last reply stated, a whole one before any reply states them."""
    roster = Roster(microbatch_size=1)
    roster.refresh([_view("a", 0), _view("b", 0), _view("c", 0), _view("d", 1),
                    _view("syncing", 1, phase="weight_sync")])
    assert roster.stage_shares(3) == [3.0, 1.0, 1.0]  # nobody stated callers yet; stage 2 has no worker
    for peer, callers in (("a", 2), ("b", 4), ("d", 3)):
        roster.started(peer)
        roster.succeeded(peer, 0.1, callers=callers)
    assert roster.stage_shares(2) == [0.5 + 0.25 + 1.0, 1 / 3]
    roster.started("a")
    roster.succeeded("a", 0.1)  # a reply that states no callers leaves the last statement
    assert roster.share_of_stage(0) == 1.75
    roster.started("c")
    roster.failed("c", now=0.0)  # failing: not sharing the stage's work now
    assert roster.share_of_stage(0) == 0.75
    roster.started("d")
    roster.failed("d", now=0.0)  # no replica sharing: waited on as one, not as none
    assert roster.share_of_stage(1) == 1.0
    roster.exclude("a")
    assert roster.share_of_stage(0) == 0.25


def test_refresh_keeps_local_observations_and_drops_departed_workers():
    roster = Roster(microbatch_size=2)
    roster.refresh([_view("a", stage=1), _view("b", stage=1)])
    roster.started("a")
    roster.succeeded("a", 0.7)
    roster.refresh([_view("a", stage=1, announced_queue=3)])
    assert list(roster.workers) == ["a"]
    assert roster.workers["a"].measured_seconds == 0.7 and roster.workers["a"].announced_queue == 3
    assert roster.choose(1, now=0).peer_id == "a" and roster.choose(0, now=0) is None


def test_shares_balance_equally_fast_replicas_but_not_at_any_price():
    a = _view("a", measured_seconds=1.0)
    b = _view("b", measured_seconds=1.1)
    shares = {"a": 2, "b": 1}
    # Without shares the earliest finish wins; with them the replica behind on this batch does,
    # although it is a little slower (1.1 s against 1.0 s).
    assert pick_worker([a, b], 0, 4).peer_id == "a"
    assert pick_worker([a, b], 0, 4, shares=shares).peer_id == "b"
    assert pick_worker([a, b], 0, 4, shares={"a": 1, "b": 1}).peer_id == "a"  # equal shares: earliest finish
    b.in_flight = 1  # a queue of the moment does not undo the balance: equal shares even queues out
    assert pick_worker([a, b], 0, 4, shares=shares).peer_id == "b"
    # A replica over BALANCE_SLACK times slower per microbatch is left to the earliest-finish rule:
    # no traffic while the fast one is free, its turn once the fast one's queue is longer.
    b.measured_seconds, b.in_flight = 2.5, 0
    assert pick_worker([a, b], 0, 4, shares=shares).peer_id == "a"
    a.in_flight = 3  # 4 * 1.0 s > 2.5 s
    assert pick_worker([a, b], 0, 4, shares={"a": 0, "b": 5}).peer_id == "b"
    # Speed is compared on the announced compute throughput when every replica announces one: a
    # round trip slowed by queueing (or never refreshed) does not make a replica "slow".
    a.in_flight = 0
    a.announced_samples_per_s = b.announced_samples_per_s = 8.0
    assert pick_worker([a, b], 0, 4, shares=shares).peer_id == "b"


def test_a_batch_split_by_balanced_picks_is_even_across_replicas():
    from collections import Counter

    roster = Roster(microbatch_size=2)
    roster.refresh([_view("a", measured_seconds=1.0), _view("b", measured_seconds=1.0),
                    _view("c", measured_seconds=1.2)])
    shares = Counter()
    for _ in range(9):  # each pick is in flight until the batch is cut
        view = roster.choose(0, now=0, shares=shares)
        roster.started(view.peer_id)
        shares[view.peer_id] += 1
    assert shares == Counter({"a": 3, "b": 3, "c": 3})


def test_a_replica_left_without_traffic_is_probed_after_a_few_batches():
    from collections import Counter

    from agora.node.trainer.routing import PROBE_AFTER

    roster = Roster(microbatch_size=2)
    fast = WorkerView("fast", "f:1", 0, announced_samples_per_s=100.0)
    slow = WorkerView("slow", "s:1", 0, announced_samples_per_s=10.0)  # measured in a bad moment, long ago
    roster.refresh([fast, slow])
    for _ in range(PROBE_AFTER):
        shares = Counter()
        for _ in range(4):
            shares[roster.choose(0, 0.0, shares=shares).peer_id] += 1
        assert shares == {"fast": 4}
        roster.batch_done(0, shares)
    shares = Counter()
    picks = []
    for _ in range(4):
        picks.append(roster.choose(0, 0.0, shares=shares).peer_id)
        shares[picks[-1]] += 1
    assert picks[0] == "slow" and picks[1:] == ["fast"] * 3  # one microbatch measures it afresh
    roster.batch_done(0, shares)
    assert roster.workers["slow"].idle_batches == 0
