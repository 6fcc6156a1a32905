"""How the traces in this folder were recorded: send a workload to a running server, then save
its replay ring's export (GET /debug/trace?last=N).

    .venv/bin/caldrix serve --port 18601 --max-batch 4 &
    .venv/bin/python traces/record.py burst --url http://127.0.0.1:18601 > traces/burst_short_chats.jsonl
    .venv/bin/python traces/record.py shared-prefix --url http://127.0.0.1:18601 > traces/long_shared_prefix.jsonl

The prompts below exist only in this script: the trace keeps their lengths and block digests.
"""

from __future__ import annotations

import argparse
import random
import sys

import httpx
import trio

QUESTIONS = [
    "What is the capital of France?", "Give me a synonym for happy.", "How many legs does a spider have?",
    "Say hello in Spanish.", "What colour is the sky on a clear day?", "Name a prime number above 50.",
    "What is 12 times 12?", "Suggest a name for a grey cat.", "What does CPU stand for?",
    "Which planet is known as the red planet?", "Tell me a one-line joke.", "What is the boiling point of water?",
    "Translate 'thank you' into French.", "What is the opposite of cold?", "Name three fruits.",
    "How many days are in a leap year?",
]

MANUAL = """You are the support assistant for the Brightwater BW-200 espresso machine. Answer only from this manual.
Setup: place the machine on a flat, dry surface at least ten centimetres from the wall. Fill the water tank with
fresh cold water up to the MAX line; never use sparkling or distilled water. Plug in the machine and press the power
button; the indicator blinks while the boiler heats and stays lit when the machine is ready, after about ninety seconds.
Brewing: insert the portafilter with seven grams of finely ground coffee for a single shot or fourteen grams for a double.
Tamp firmly and evenly. Press the one-cup or two-cup button. A single shot takes about twenty-five seconds. If the shot
runs faster than fifteen seconds, grind finer; if slower than thirty-five seconds, grind coarser.
Milk: purge the steam wand for two seconds, then submerge the tip just under the surface of cold milk. Open the steam
knob fully. Lower the jug as the milk expands, and stop at sixty-five degrees Celsius. Wipe and purge the wand after use.
Cleaning: empty the drip tray daily. Rinse the portafilter and shower screen after every session. Descale every two
months with the Brightwater descaling solution: fill the tank with the solution, run the steam wand and the group head
alternately until the tank is empty, then rinse with two full tanks of clean water.
Troubleshooting: if no water comes out, check that the tank is seated and the water level is above MIN. If the machine
shows three blinking lights, it needs descaling. If the pump is loud, the tank may be empty. Error E1 means the boiler
sensor failed; contact support. Error E2 means the machine overheated; unplug it for thirty minutes.
Warranty: two years from purchase, covering manufacturing defects but not damage from scale, misuse or unapproved parts.
Always answer briefly and politely, and suggest contacting Brightwater support when the manual does not cover a question."""

MANUAL_QUESTIONS = [
    "How long does a single shot take?", "My machine shows three blinking lights. What now?",
    "What does error E2 mean?", "How often should I descale?", "Can I use sparkling water?",
    "How much coffee for a double shot?", "At what temperature should I stop steaming milk?",
    "Is scale damage covered by the warranty?",
]


def burst(rng: random.Random) -> list[tuple[float, dict]]:
    """Sixteen short chats arriving within about a second and a half."""
    out = []
    for i, q in enumerate(QUESTIONS):
        body = {"messages": [{"role": "user", "content": q}], "max_tokens": rng.choice([8, 12, 16, 24]),
                "stream": i % 3 == 0}
        if i % 2:
            body.update(temperature=0.7, top_p=0.9, seed=1000 + i)
        out.append((rng.uniform(0, 1.5), body))
    return sorted(out, key=lambda x: x[0])


def shared_prefix(rng: random.Random) -> list[tuple[float, dict]]:
    """Eight questions under one long system prompt, and three short chats, over about eight seconds."""
    out = []
    for i, q in enumerate(MANUAL_QUESTIONS):
        body = {"messages": [{"role": "system", "content": MANUAL}, {"role": "user", "content": q}],
                "max_tokens": rng.choice([8, 12, 16]), "stream": i % 2 == 0}
        if i % 4 == 3:
            body.update(temperature=0.5, top_k=40, seed=2000 + i)
        out.append((rng.uniform(0, 8.0), body))
    for q in QUESTIONS[:3]:
        out.append((rng.uniform(0, 8.0), {"messages": [{"role": "user", "content": q}], "max_tokens": 8}))
    return sorted(out, key=lambda x: x[0])


async def send_all(url: str, workload: list[tuple[float, dict]]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(body: dict) -> None:
            r = await client.post("/v1/chat/completions", json={"model": model, **body})
            r.raise_for_status()

        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for at, body in workload:
                await trio.sleep_until(t0 + at)
                nursery.start_soon(one, body)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("workload", choices=["burst", "shared-prefix"])
    p.add_argument("--url", default="http://127.0.0.1:8425")
    args = p.parse_args()
    workload = (burst if args.workload == "burst" else shared_prefix)(random.Random(5))
    trio.run(send_all, args.url, workload)
    trio.run(trio.sleep, 1.0)  # a stream's record is completed just after its last byte
    trace = httpx.get(f"{args.url}/debug/trace", params={"last": len(workload)}).text
    sys.stdout.write(trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
