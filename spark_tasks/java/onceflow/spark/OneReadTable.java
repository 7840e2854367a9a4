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

/**
 * What onceflow's readers' tables share: each is one read, so the table is its own scan
 * builder, scan and batch; a reader names itself, its schema, its input partitions and the
 * factory of their readers.
 */
@SuppressWarnings("deprecation")  // Table.schema(): what Spark 4.2 still reads
abstract class OneReadTable implements SupportsRead, Scan, ScanBuilder, Batch {
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
    return schema();
  }

  @Override
  public Batch toBatch() {
    return this;
  }

  /**
   * The readers' factory, shipped to the executors: a segment is read by a SegmentReader, a
   * chunk of JSON lines by a ChunkReader, both decoding the same declared columns.
   */
  static final class Readers implements PartitionReaderFactory {
    private static final long serialVersionUID = 1L;
    private final String[][] columns;
    private final long maxRecordBytes;

    Readers(String[][] columns, long maxRecordBytes) {
      this.columns = columns;
      this.maxRecordBytes = maxRecordBytes;
    }

    @Override
    public PartitionReader<InternalRow> createReader(InputPartition partition) {
      if (partition instanceof SegmentsTable.Segment segment) {
        return new SegmentReader(segment, columns, maxRecordBytes);
      }
      return new ChunkReader((ReadSpec.Chunk) partition, columns, maxRecordBytes);
    }
  }
}
