// One stage of a pub/sub pipeline written from the JavaScript SDK's documentation alone
// (`@dapr/dapr` from npm, unchanged): a DaprServer subscribed to topic IN; for each event it
// publishes the next stage's event to topic OUT with a DaprClient, as a CloudEvent whose id is
// derived from the order (publishing it again after a retry is the same event) and which
// carries the delivery's W3C trace context. The first delivery of order 2 is published and
// then answered RETRY, so the stage publishes it twice. It knows nothing of cosmosq.
//
// At start it also publishes to a topic it was not granted and prints the answer.
//
// Usage: node dapr_pipeline_stage.cjs APP_PORT IN OUT   (OUT "-": the last stage publishes
// nothing)   (DAPR_HTTP_PORT: the sidecar's port)
// Prints one JSON line per step and per event received.
const {
  DaprServer,
  DaprClient,
  DaprPubSubStatusEnum,
  CommunicationProtocolEnum,
  LogLevel,
} = require("@dapr/dapr");

const [appPort, input, output] = process.argv.slice(2);
const daprHost = "127.0.0.1";
const daprPort = process.env.DAPR_HTTP_PORT;
const print = (line) => console.log(JSON.stringify(line));

async function main() {
  const logger = { level: LogLevel.Error };
  const server = new DaprServer({
    serverHost: "127.0.0.1",
    serverPort: appPort,
    communicationProtocol: CommunicationProtocolEnum.HTTP,
    clientOptions: { daprHost, daprPort, logger },
    logger,
  });
  const client = new DaprClient({
    daprHost,
    daprPort,
    communicationProtocol: CommunicationProtocolEnum.HTTP,
    logger,
  });
  const retried = new Set();
  await server.pubsub.subscribe("pubsub", input, async (data, headers) => {
    const traceparent = headers["traceparent"] || null;
    print({ step: "received", topic: input, data, traceparent });
    if (output === "-") return DaprPubSubStatusEnum.SUCCESS;
    const published = await client.pubsub.publish(
      "pubsub",
      output,
      {
        specversion: "1.0",
        id: `${output}-${data.order}`,
        source: `stage-${input}`,
        type: `${output}.created`,
        datacontenttype: "application/json",
        data: { ...data, [input]: "done" },
        ...(traceparent ? { traceparent } : {}),
      },
      { contentType: "application/cloudevents+json" },
    );
    if (published.error) {
      print({ step: "publish failed", error: String(published.error) });
      return DaprPubSubStatusEnum.RETRY;
    }
    print({ step: "published", order: data.order });
    if (data.order === 2 && !retried.has(data.order)) {
      retried.add(data.order);
      return DaprPubSubStatusEnum.RETRY;
    }
    return DaprPubSubStatusEnum.SUCCESS;
  });
  // Starts the app's server, then waits until the sidecar answers its metadata.
  await server.start();
  await client.start();
  const forbidden = await client.pubsub.publish("pubsub", "payments", { order: 0 });
  print({ step: "forbidden", error: forbidden.error ? String(forbidden.error) : null });
  print({ step: "server started" });
}

main().catch((error) => {
  print({ step: "failed", error: String(error && error.stack ? error.stack : error) });
  process.exit(1);
});
