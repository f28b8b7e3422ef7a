// Copies protocol.tables.json (written by `python -m vllm_realtime_protocol.schema --tables`)
// into realtime-client.js, between its BEGIN/END lines, so the client stays one dependency-free
// module in browsers. Run through `make types`; tests/clients/test_types_drift.py fails when the
// copy drifts.
import { readFile, writeFile } from "node:fs/promises";

const [tablesPath, clientPath] = process.argv.slice(2);
if (!tablesPath || !clientPath) {
  console.error("usage: node scripts/embed-tables.mjs protocol.tables.json realtime-client.js");
  process.exit(2);
}
const BEGIN = "// BEGIN protocol.tables.json\n";
const END = "// END protocol.tables.json\n";
const tables = (await readFile(tablesPath, "utf8")).trimEnd();
JSON.parse(tables); // refuse to embed what is not JSON
const client = await readFile(clientPath, "utf8");
const start = client.indexOf(BEGIN);
const stop = client.indexOf(END);
if (start < 0 || stop < start) {
  console.error(`${clientPath}: no BEGIN/END protocol.tables.json lines`);
  process.exit(1);
}
const block = `export const PROTOCOL_TABLES = ${tables};\n`;
await writeFile(clientPath, client.slice(0, start + BEGIN.length) + block + client.slice(stop));
