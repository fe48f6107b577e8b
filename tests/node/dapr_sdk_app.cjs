// A Dapr pub/sub app written from the JavaScript SDK's documentation alone (`@dapr/dapr` from
// npm, unchanged): a DaprServer subscribed to a topic, and a DaprClient that publishes one
// event and a bulk of two, then sets an attribute and reads the sidecar's metadata. It knows nothing of cosmosq.
//
// With MODE "rules" the subscription is made with `subscribeWithOptions`: a routing rule (CEL
// over the CloudEvent) sends widgets to one handler and everything else to the default's, and
// the client publishes one of each. With MODE "subscribe" it only subscribes (another
// publishes). With MODE "grpc" the server and the client speak gRPC (the server is a gRPC app
// the sidecar calls through Dapr's AppCallback; the client calls Dapr's gRPC API at
// DAPR_GRPC_PORT).
//
// Usage: node dapr_sdk_app.cjs APP_PORT TOPIC [MODE]   (DAPR_HTTP_PORT: the sidecar's port)
// Prints one JSON line per step and per event received.
const { DaprServer, DaprClient, CommunicationProtocolEnum, LogLevel } = require("@dapr/dapr");

const [appPort, topic, mode] = process.argv.slice(2);
const daprHost = "127.0.0.1";
const grpc = mode === "grpc";
const communicationProtocol = grpc
  ? CommunicationProtocolEnum.GRPC
  : CommunicationProtocolEnum.HTTP;
const daprPort = grpc ? process.env.DAPR_GRPC_PORT : process.env.DAPR_HTTP_PORT;
const print = (line) => console.log(JSON.stringify(line));

async function main() {
  const logger = { level: LogLevel.Error };
  const server = new DaprServer({
    serverHost: "127.0.0.1",
    serverPort: appPort,
    communicationProtocol,
    clientOptions: { daprHost, daprPort, communicationProtocol, logger },
    logger,
  });
  if (mode === "rules") {
    await server.pubsub.subscribeWithOptions("pubsub", topic, {
      route: {
        rules: [{ match: 'event.data.kind == "widget"', path: "widgets" }],
        default: "others",
      },
    });
    for (const route of ["widgets", "others"]) {
      server.pubsub.subscribeToRoute("pubsub", topic, route, async (data) => {
        print({ step: "received", route, data });
      });
    }
  } else {
    await server.pubsub.subscribe("pubsub", topic, async (data, headers) => {
      print({ step: "received", data, traceparent: headers["traceparent"] || null });
    });
  }
  // Starts the app's server, then waits until the sidecar answers its metadata.
  await server.start();
  print({ step: "server started" });
  if (mode === "subscribe") return;

  const client = new DaprClient({ daprHost, daprPort, communicationProtocol, logger });
  await client.start();

  if (mode === "rules") {
    for (const kind of ["widget", "gadget"]) {
      const published = await client.pubsub.publish("pubsub", topic, { kind });
      if (published.error) throw published.error;
    }
    print({ step: "published" });
    return;
  }
  const published = await client.pubsub.publish("pubsub", topic, { from: "node" });
  if (published.error) throw published.error;
  print({ step: "published" });
  const bulk = await client.pubsub.publishBulk("pubsub", topic, [
    { from: "node-bulk" },
    "node bulk text",
  ]);
  print({ step: "published in bulk", failed: bulk.failedMessages.length });
  await client.metadata.set("team", "payments");
  const metadata = await client.metadata.get();
  print({ step: "metadata", metadata });
}

main().catch((error) => {
  print({ step: "failed", error: String(error && error.stack ? error.stack : error) });
  process.exit(1);
});
