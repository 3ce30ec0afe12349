"""The time-sharing slots (search.slots.Slots, the plain class behind the actor): at most `capacity`
holders; a freed slot goes to the waiting member with the fewest steps, then to the earliest to ask."""

from __future__ import annotations

import asyncio

from search.slots import Slots


def test_slots_go_to_the_member_with_the_fewest_steps_and_never_exceed_capacity():
    async def scenario() -> list[str]:
        slots, order = Slots(2), []

        async def member(name: str, steps: int) -> None:
            await slots.acquire(name, steps)
            order.append(name)

        assert await slots.acquire("a", 0) == 1 and await slots.acquire("b", 0) == 2
        late = [asyncio.create_task(member(n, s)) for n, s in (("c", 20), ("d", 10), ("e", 10))]
        await asyncio.sleep(0)  # the three are queued (an event loop turn, not a wait for time)
        assert await slots.waiting() == 3 and order == []
        await slots.release("a")  # granted within release: the holders change at once
        assert slots.holders == {"b", "d"}  # fewest steps first
        await slots.release("b")
        assert slots.holders == {"d", "e"}  # a tie goes to the earliest to ask
        await slots.release("d")
        assert slots.holders == {"e", "c"}
        await asyncio.gather(*late)
        assert order == ["d", "e", "c"]
        assert (await slots.stats())["most_at_once"] == 2
        await slots.release("c")  # a member that is not queued or holding: nothing happens
        await slots.release("nobody")
        return order

    asyncio.run(scenario())


def test_a_released_waiter_leaves_the_queue():
    async def scenario() -> None:
        slots = Slots(1)
        await slots.acquire("a", 0)
        waiter = asyncio.create_task(slots.acquire("b", 0))
        await asyncio.sleep(0)
        await slots.release("b")  # its trial ended while it waited (SlotRelease)
        waiter.cancel()
        assert await slots.waiting() == 0
        await slots.release("a")
        assert await slots.acquire("c", 5) == 1

    asyncio.run(scenario())
