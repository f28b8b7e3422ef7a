// The JS ClientMachine against the Python ClientProtocol: machine-sequences.json holds sends and
// server events with the state the Python machine is in after each (written by
// `python -m tests.clients.machine_sequences`; tests/clients/test_types_drift.py keeps it the
// Python machine's). Replayed here step by step, the JS machine must say the same after every step.
import assert from "node:assert/strict";
import { readFile } from "node:fs/promises";
import { test } from "node:test";

import { ClientMachine, PROTOCOL_TABLES, RealtimeError } from "../realtime-client.js";

const SEQUENCES = JSON.parse(await readFile(new URL("./machine-sequences.json", import.meta.url), "utf8"));
const TABLES = JSON.parse(await readFile(new URL("../protocol.tables.json", import.meta.url), "utf8"));

function observe(machine, refused, internal) {
  return {
    state: machine.state,
    next: machine.nextFrameIndex,
    in_flight: machine.inFlightFrameIndex,
    unanswered: machine.unanswered.map((sent) => sent.input),
    busy: machine.busy,
    refused,
    internal,
  };
}

function codeOf(step) {
  try {
    step();
    return null;
  } catch (err) {
    assert.ok(err instanceof RealtimeError && err.local, `not a local RealtimeError: ${err}`);
    return err.code;
  }
}

test("the client runs on the protocol's tables (the copy in realtime-client.js is protocol.tables.json)", () => {
  assert.deepEqual(PROTOCOL_TABLES, TABLES);
});

test("the JS machine says what the Python machine says after every step of every sequence", () => {
  let steps = 0;
  const pairs = new Set();
  SEQUENCES.forEach((sequence, n) => {
    let machine = new ClientMachine();
    sequence.forEach((step, k) => {
      if (step.new_machine) {
        machine = new ClientMachine();
        return;
      }
      const before = machine.state;
      let refused = null;
      let internal = false;
      if (step.send) {
        refused = codeOf(() => machine.send(step.send));
        pairs.add(`${before} ${ClientMachine.inputOf(step.send)}`);
      } else if (step.binary !== undefined) {
        refused = codeOf(() => machine.sendBinary(new Uint8Array(step.binary)));
        pairs.add(`${before} binary`);
      } else if (step.lost) {
        machine.connectionLost();
      } else {
        const code = codeOf(() => machine.receive(step.receive));
        internal = code === "internal_error";
        assert.ok(code === null || internal, `receive threw ${code}`);
      }
      assert.deepEqual(observe(machine, refused, internal), step.expect, `sequence ${n}, step ${k}: ${JSON.stringify(step)}`);
      steps += 1;
    });
  });
  assert.ok(steps > 500, `only ${steps} steps`);
  // The sequences reach every client input from every state the client holds, but a closed one's.
  for (const state of ["connected", "idle", "awaiting_binary", "awaiting_response"]) {
    for (const input of ["session.open", "frame.append", "frame.append(binary)", "binary", "response.cancel", "session.update"]) {
      assert.ok(pairs.has(`${state} ${input}`), `never sent ${input} in ${state}`);
    }
  }
});

test("an update while a chunk awaits its input.ack: answered in order, no internal error", () => {
  const m = new ClientMachine();
  m.receive({ type: "session.created", session_id: "s", limits: {} });
  m.send({ type: "session.open", event_id: "o" });
  m.receive({ type: "session.opened", session_id: "s", config: { resumable: { grace_s: 5 } }, limits: {}, resume_token: "t" });
  m.send({ type: "frame.append", event_id: "c" });
  m.send({ type: "session.update", event_id: "u" });
  assert.deepEqual(m.unanswered.map((s) => s.input), ["frame.append", "session.update"]);
  m.receive({ type: "input.ack", frame_index: 0 });
  m.receive({ type: "session.updated", session_id: "s", config: { resumable: { grace_s: 5 } } });
  assert.deepEqual([m.state, m.unanswered, m.inFlightFrameIndex, m.nextFrameIndex], ["awaiting_response", [], 0, 1]);
  assert.throws(() => m.send({ type: "frame.append", event_id: "c2" }), (err) => err.code === "chunk_in_flight" && err.local);
  m.connectionLost();
  assert.equal(m.state, "parked_awaiting_response");
  assert.equal(m.busy, true);
});
