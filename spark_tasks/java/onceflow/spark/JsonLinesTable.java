package onceflow.spark;

import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.sql.connector.read.PartitionReaderFactory;
import org.apache.spark.sql.types.StructType;

/** The table, scan and batch of one read: one input partition per chunk. */
final class JsonLinesTable extends OneReadTable {
  private final ReadSpec spec;

  JsonLinesTable(ReadSpec spec) {
    this.spec = spec;
  }

  @Override
  public String name() {
    return "onceflow-jsonl";
  }

  @Override
  public StructType schema() {
    return spec.schema();
  }

  @Override
  public String description() {
    return "onceflow JSON lines: " + spec.chunks.size() + " chunk(s)";
  }

  @Override
  public InputPartition[] planInputPartitions() {
    return spec.chunks.toArray(new InputPartition[0]);
  }

  @Override
  public PartitionReaderFactory createReaderFactory() {
    return new Readers(spec.columns, spec.maxRecordBytes);
  }
}
