package onceflow.spark;

import java.util.EnumSet;
import java.util.Set;

import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.connector.catalog.SupportsRead;
import org.apache.spark.sql.connector.catalog.TableCapability;
import org.apache.spark.sql.connector.read.Batch;
import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.sql.connector.read.PartitionReader;
import org.apache.spark.sql.connector.read.PartitionReaderFactory;
import org.apache.spark.sql.connector.read.Scan;
import org.apache.spark.sql.connector.read.ScanBuilder;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;

/** The table, scan and batch of one read: one input partition per chunk. */
@SuppressWarnings("deprecation")  // Table.schema(): what Spark 4.2 still reads
final class JsonLinesTable implements SupportsRead, Scan, ScanBuilder, Batch {
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
  public Set<TableCapability> capabilities() {
    return EnumSet.of(TableCapability.BATCH_READ);
  }

  @Override
  public ScanBuilder newScanBuilder(CaseInsensitiveStringMap options) {
    return this;
  }

  @Override
  public Scan build() {
    return this;
  }

  @Override
  public StructType readSchema() {
    return spec.schema();
  }

  @Override
  public String description() {
    return "onceflow JSON lines: " + spec.chunks.size() + " chunk(s)";
  }

  @Override
  public Batch toBatch() {
    return this;
  }

  @Override
  public InputPartition[] planInputPartitions() {
    return spec.chunks.toArray(new InputPartition[0]);
  }

  @Override
  public PartitionReaderFactory createReaderFactory() {
    return new Factory(spec.columns, spec.maxRecordBytes);
  }

  static final class Factory implements PartitionReaderFactory {
    private static final long serialVersionUID = 1L;
    private final String[][] columns;
    private final long maxRecordBytes;

    Factory(String[][] columns, long maxRecordBytes) {
      this.columns = columns;
      this.maxRecordBytes = maxRecordBytes;
    }

    @Override
    public PartitionReader<InternalRow> createReader(InputPartition partition) {
      return new ChunkReader((ReadSpec.Chunk) partition, columns, maxRecordBytes);
    }
  }
}
