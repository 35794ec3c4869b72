"""pipeline/dali.py's GraphRunner with a stand-in graph (no DALI needed): the order in which
it asks for outputs, fetches them and waits for the device copies out of them. On a GPU,
`to_cuda` queues a copy out of DALI's output buffer and hands its event to the runner's
fence; DALI may refill that buffer once the next output is asked for (or free it with the
graph), so the runner must wait on the event then: not sooner (the decode thread would stall
on every batch's copy, the host sync this replaced) and never later."""

from __future__ import annotations

from shardflow.dali import GraphRunner


class Graph:
    """Records what the runner does to it; output i is batch i's value."""

    def __init__(self, log: list[str], fail_on: int | None = None) -> None:
        self.log, self.fail_on, self.fed, self.asked = log, fail_on, [], 0

    def feed(self, item: int) -> None:
        self.fed.append(item)

    def schedule_run(self) -> None:
        self.log.append("run")

    def outputs(self) -> tuple[int]:
        item = self.fed[self.asked]
        self.asked += 1
        self.log.append(f"outputs {item}")
        if item == self.fail_on:
            self.fail_on = None
            raise RuntimeError("bad sample")
        return (item,)


class Event:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(f"wait {self.name}")


def runner(log: list[str], fail_on: int | None = None) -> GraphRunner:
    graphs: list[Graph] = []

    def build(depth: int) -> Graph:
        log.append("build")
        graphs.append(Graph(log, fail_on if not graphs else None))
        return graphs[-1]

    def fetch(out: int, item: int) -> int:
        log.append(f"copy {out}")
        r.fence.add(Event(log, f"copy {out}"))  # what to_cuda does
        return out * 10

    r = GraphRunner(build, lambda g, item: g.feed(item), fetch, lambda item: False, depth=2)
    return r


def test_a_copy_is_waited_on_before_the_next_output_not_after_queuing_it():
    log: list[str] = []
    r = runner(log)
    for _, result in r.run(iter([1, 2, 3]), lambda item, exc: item):
        log.append(f"consumer got {result}")  # the batch goes on while its copy runs
    r.close()
    steps = [s for s in log if s != "run"]
    assert steps == ["build", "outputs 1", "copy 1", "consumer got 10", "wait copy 1",
                     "outputs 2", "copy 2", "consumer got 20", "wait copy 2", "outputs 3",
                     "copy 3", "consumer got 30", "wait copy 3"]  # the last: at close


def test_a_failed_graph_is_dropped_only_after_the_copies_out_of_it():
    log: list[str] = []
    r = runner(log, fail_on=2)
    out = [result for _, result in r.run(iter([1, 2, 3]), lambda item, exc: item)]
    assert out == [10, 20, 30]  # batch 2 ran again in a new graph
    steps = [s for s in log if s != "run"]
    failed = steps.index("outputs 2")
    assert steps[failed - 1] == "wait copy 1" and steps[failed + 1] == "build"
    assert not r.fence.events or steps[-1] == "copy 3"


def test_abandoning_a_pass_waits_for_its_copies_before_letting_the_graph_go():
    log: list[str] = []
    r = runner(log)
    results = r.run(iter([1, 2, 3, 4]), lambda item, exc: item)
    assert next(results)[1] == 10
    results.close()  # a `break` in the consumer: batches still inside the graph
    assert log[-1] == "wait copy 1" and r.graph is None and not r.fence.events
