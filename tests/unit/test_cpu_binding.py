"""Which CPUs engine threads get (disagg.hosts.cpu_binding), and the step loop's thread taking them."""

from __future__ import annotations

import os
import threading

import pytest

from disagg.hosts.cpu_binding import keep_off_engine_cpus, plan_cpus
from disagg.config import PoolConfig, ServingConfig
from disagg.engine.step_loop import StepLoop


def test_by_default_two_cpus_stay_with_the_rest_so_a_machine_of_two_binds_nothing():
    assert plan_cpus(ServingConfig(), [0, 1]) is None
    plan = plan_cpus(ServingConfig(), [0, 1, 2])
    assert plan.engine_cpus("prefill", 0) == {2}
    assert plan.framework == {0, 1}
    assert plan.engine_cpus("decode", 0) == {0, 1, 2}, "an engine without a CPU of its own runs anywhere"


def test_binding_on_leaves_the_rest_one_cpu():
    plan = plan_cpus(ServingConfig(cpu_binding="on"), [0, 1])
    assert plan.engine_cpus("prefill", 0) == {1}
    assert plan.framework == {0}
    assert plan.engine_cpus("decode", 0) == {0, 1}


def test_every_engine_gets_its_own_cpus_when_the_machine_has_enough():
    config = ServingConfig(
        prefill=PoolConfig(num_instances=2), decode=PoolConfig(num_instances=2), threads_per_worker=2
    )
    plan = plan_cpus(config, range(16))
    owned = [plan.engine_cpus(role, i) for role in ("prefill", "decode") for i in range(2)]
    assert [len(cpus) for cpus in owned] == [2, 2, 2, 2]
    assert len(set().union(*owned)) == 8, "no two engines share a CPU"
    assert plan.framework == set(range(8)), "the rest, CPU 0 among them, for everything else"


def test_an_instance_with_more_threads_gets_as_many_cpus():
    config = ServingConfig(prefill=PoolConfig(num_instances=2, instances=[{}, {"threads_per_worker": 3}]))
    plan = plan_cpus(config, range(8))
    assert [len(plan.engine_cpus("prefill", i)) for i in range(2)] == [1, 3]


def test_prefill_engines_come_first_and_the_rest_keeps_its_cpus():
    config = ServingConfig(prefill=PoolConfig(num_instances=2), decode=PoolConfig(num_instances=1))
    plan = plan_cpus(config, [0, 1, 2, 3])
    assert set(plan.engines) == {("prefill", 0), ("prefill", 1)}
    assert plan.framework == {0, 1}
    plan = plan_cpus(
        ServingConfig(prefill=PoolConfig(num_instances=2), decode=PoolConfig(num_instances=1), cpu_binding="on"),
        [0, 1, 2, 3],
    )
    assert set(plan.engines) == {("prefill", 0), ("prefill", 1), ("decode", 0)}
    assert plan.framework == {0}


def test_colocated_engines_are_bound_too():
    plan = plan_cpus(ServingConfig(mode="colocated"), [0, 1, 2])
    assert plan.engine_cpus("colocated", 0) == {2}


def test_no_plan_when_binding_is_off_one_cpu_is_all_there_is_or_instances_span_several_workers():
    assert plan_cpus(ServingConfig(cpu_binding="off"), [0, 1]) is None
    assert plan_cpus(ServingConfig(cpu_binding="on"), [3]) is None
    tp2 = PoolConfig(tensor_parallel_size=2)
    assert plan_cpus(ServingConfig(prefill=tp2, decode=tp2), range(8)) is None


def test_an_unknown_binding_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="cpu_binding"):
        ServingConfig(cpu_binding="all")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to bind one")
def test_the_step_loop_thread_runs_on_the_cpus_it_is_given_and_leaves_the_others_alone():
    cpus = sorted(os.sched_getaffinity(0))
    seen = []
    ran = threading.Event()

    def step():
        seen.append(os.sched_getaffinity(0))
        ran.set()

    loop = StepLoop(step, lambda: not ran.is_set(), name="bound", cpus=[cpus[-1]])
    loop.start()
    try:
        assert ran.wait(10)
    finally:
        loop.stop()
    assert seen == [{cpus[-1]}]
    assert os.sched_getaffinity(0) == set(cpus), "the thread that started the loop keeps its CPUs"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to bind one")
def test_threads_the_engine_thread_started_go_back_to_the_framework_cpus():
    cpus = sorted(os.sched_getaffinity(0))
    framework, started, release = {cpus[0]}, [], threading.Event()
    engine_bound = threading.Event()

    def engine():
        os.sched_setaffinity(0, {cpus[-1]})
        helper = threading.Thread(target=release.wait, args=(10,))
        helper.start()  # inherits the engine's CPUs, as a KV channel's thread would
        started.append(helper)
        engine_bound.set()
        release.wait(10)

    thread = threading.Thread(target=engine)
    thread.start()
    try:
        assert engine_bound.wait(10)
        assert os.sched_getaffinity(started[0].native_id) == {cpus[-1]}
        os.sched_setaffinity(0, framework)  # as a worker's other threads are
        assert keep_off_engine_cpus(thread.native_id, framework) >= 1
        assert os.sched_getaffinity(started[0].native_id) == framework
        assert os.sched_getaffinity(thread.native_id) == {cpus[-1]}, "the engine thread stays"
    finally:
        os.sched_setaffinity(0, set(cpus))
        release.set()
        thread.join(10)
        keep_off_engine_cpus(-1, set(cpus))  # this process's threads get all their CPUs back
