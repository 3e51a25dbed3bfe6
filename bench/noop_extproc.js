// A do-nothing ext_proc server in Node.js: the floor of an ext_proc hop outside Python.
//
//   node bench/noop_extproc.js PATH_TO_GRPC_JS      (prints its port, then serves)
//
// `python -m bench.floor` sets it beside `bench.server passthrough`, the same
// do-nothing hop in Python, to tell what Envoy's ext_proc exchange costs by
// itself from what a Python gRPC server adds to it. It answers exactly as the
// Python one does, in the picker's processing mode: the request headers reply
// is held until the body ends (FULL_DUPLEX_STREAMED forwards only what comes
// back), then the body goes back whole as streamed_response pieces; request
// trailers end a held body; every other message gets an empty reply of its kind.
//
// The messages are read and written by hand, with their protobuf field numbers
// (envoy/service/ext_proc/v3/external_processor.proto), and grpc-js is given
// identity (de)serialisers: the server decodes only the fields it needs, the
// least any implementation can do, so what it adds is the hop itself.
"use strict";

const grpc = require(process.argv[2] || "@grpc/grpc-js");

// ProcessingRequest's oneof `request`.
const REQUEST_HEADERS = 2, RESPONSE_HEADERS = 3, REQUEST_BODY = 4, RESPONSE_BODY = 5;
const REQUEST_TRAILERS = 6, RESPONSE_TRAILERS = 7;
// The empty replies, as the Python services serialise them (wire.extproc).
const reply = (hex) => Buffer.from(hex, "hex");
const EMPTY = {
  [REQUEST_HEADERS]: reply("0a020a00"), // request_headers { response {} }
  [RESPONSE_HEADERS]: reply("12020a00"), // response_headers { response {} }
  [REQUEST_BODY]: reply("1a020a00"), // request_body { response {} }
  [RESPONSE_BODY]: reply("22020a00"), // response_body { response {} }
  [REQUEST_TRAILERS]: reply("2a00"), // request_trailers {}
  [RESPONSE_TRAILERS]: reply("3200"), // response_trailers {}
};

function readVarint(buffer, at) {
  let value = 0, shift = 0, byte;
  do {
    byte = buffer[at++];
    value += (byte & 0x7f) * 2 ** shift;
    shift += 7;
  } while (byte & 0x80);
  return [value, at];
}

function varint(value) {
  const bytes = [];
  while (value > 127) {
    bytes.push((value % 128) | 0x80);
    value = Math.floor(value / 128);
  }
  bytes.push(value);
  return Buffer.from(bytes);
}

// The fields of one message: [number, value], value a number (varint) or a Buffer.
function fields(buffer) {
  const found = [];
  let at = 0;
  while (at < buffer.length) {
    let key, value;
    [key, at] = readVarint(buffer, at);
    const wire = key & 7;
    if (wire === 0) {
      [value, at] = readVarint(buffer, at);
    } else if (wire === 2) {
      let length;
      [length, at] = readVarint(buffer, at);
      value = buffer.subarray(at, at + length);
      at += length;
    } else if (wire === 1 || wire === 5) {
      at += wire === 1 ? 8 : 4;
      continue;
    } else {
      throw new Error(`unexpected wire type ${wire}`);
    }
    found.push([key >> 3, value]);
  }
  return found;
}

const nested = (tag, payload) => Buffer.concat([Buffer.from([tag]), varint(payload.length), payload]);

// request_body { response { body_mutation { streamed_response { body, end_of_stream } } } },
// the body cut in pieces of at most CHUNK_LIMIT bytes, only the last one ending the stream
// (and only if asked), as wire.extproc.streamed_body_responses does. Empty and false
// fields are left out, as protobuf serialises them.
const CHUNK_LIMIT = 62000;
function streamedBody(body, endOfStream) {
  if (body.length === 0 && !endOfStream) return [];
  const pieces = [];
  for (let at = 0; at < body.length || pieces.length === 0; at += CHUNK_LIMIT) {
    pieces.push(body.subarray(at, at + CHUNK_LIMIT));
  }
  return pieces.map((piece, i) => {
    const parts = [];
    if (piece.length) parts.push(nested(0x0a, piece));
    if (endOfStream && i === pieces.length - 1) parts.push(Buffer.from([0x10, 0x01]));
    return nested(0x1a, nested(0x0a, nested(0x1a, nested(0x1a, Buffer.concat(parts)))));
  });
}

function answer(call) {
  let held = false;
  const chunks = [];
  // The held headers reply, then the body back.
  const release = (endOfStream) => {
    held = false;
    call.write(EMPTY[REQUEST_HEADERS]);
    for (const piece of streamedBody(Buffer.concat(chunks), endOfStream)) call.write(piece);
    chunks.length = 0;
  };
  call.on("data", (message) => {
    for (const [kind, value] of fields(message)) {
      if (kind === REQUEST_HEADERS) {
        const endOfStream = fields(value).some(([n, v]) => n === 3 && v);
        held = !endOfStream;
        if (!held) call.write(EMPTY[REQUEST_HEADERS]);
      } else if (kind === REQUEST_BODY) {
        let body = Buffer.alloc(0), endOfStream = false;
        for (const [n, v] of fields(value)) {
          if (n === 1) body = v;
          else if (n === 2) endOfStream = !!v;
        }
        if (!held) {
          call.write(EMPTY[REQUEST_BODY]);
          continue;
        }
        chunks.push(body);
        if (endOfStream) release(true);
      } else if (kind === REQUEST_TRAILERS) {
        if (held) release(false); // the trailers end the body
        call.write(EMPTY[REQUEST_TRAILERS]);
      } else if (kind in EMPTY) {
        call.write(EMPTY[kind]);
      }
    }
  });
  call.on("end", () => call.end());
  call.on("error", () => {});
}

const same = (x) => x;
const server = new grpc.Server();
server.addService(
  {
    Process: {
      path: "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
      requestStream: true,
      responseStream: true,
      requestSerialize: same,
      requestDeserialize: same,
      responseSerialize: same,
      responseDeserialize: same,
    },
  },
  { Process: answer },
);
server.bindAsync("127.0.0.1:0", grpc.ServerCredentials.createInsecure(), (error, port) => {
  if (error) throw error;
  console.log(port);
});
