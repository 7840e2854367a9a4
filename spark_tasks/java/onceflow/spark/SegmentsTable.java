package onceflow.spark;

import java.util.ArrayList;
import java.util.List;

import com.fasterxml.jackson.databind.JsonNode;

import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.sql.connector.read.PartitionReaderFactory;
import org.apache.spark.sql.types.StructType;

/** The table, scan and batch of one read of {@link SegmentsSource}: one task per segment. */
final class SegmentsTable extends OneReadTable {
  private final List<Segment> segments;
  private final String[][] columns;
  private final long maxRecordBytes;

  private SegmentsTable(List<Segment> segments, String[][] columns, long maxRecordBytes) {
    this.segments = segments;
    this.columns = columns;
    this.maxRecordBytes = maxRecordBytes;
  }

  static SegmentsTable parse(String json) {
    JsonNode root = ReadSpec.root(json, "onceflow-segments");
    String[][] columns = ReadSpec.columns(root);
    if (columns == null) {
      throw new IllegalArgumentException("onceflow-segments: the spec declares no columns "
          + "(payload records are read by Spark's Parquet reader)");
    }
    List<long[]> wanted = ReadSpec.wanted(root);
    List<Segment> segments = new ArrayList<>();
    for (JsonNode s : root.get("segments")) {
      int partition = s.get(1).asInt();
      segments.add(new Segment(s.get(0).asText(), partition,
          ReadSpec.wantedIn(wanted, partition)));
    }
    return new SegmentsTable(segments, columns, ReadSpec.maxRecordBytes(root));
  }

  @Override
  public String name() {
    return "onceflow-segments";
  }

  @Override
  public StructType schema() {
    return ReadSpec.schema(columns);
  }

  @Override
  public String description() {
    return "onceflow segments: " + segments.size() + " segment(s)";
  }

  @Override
  public InputPartition[] planInputPartitions() {
    return segments.toArray(new InputPartition[0]);
  }

  @Override
  public PartitionReaderFactory createReaderFactory() {
    return new Readers(columns, maxRecordBytes);
  }

  /** One segment file of a partition, and the offset ranges of that partition to keep. */
  static final class Segment implements InputPartition {
    private static final long serialVersionUID = 1L;
    final String path;
    final int partition;
    /** [start, end) offset ranges of this segment's partition to keep. */
    final long[][] wanted;

    Segment(String path, int partition, long[][] wanted) {
      this.path = path;
      this.partition = partition;
      this.wanted = wanted;
    }

    boolean wants(long offset) {
      for (long[] w : wanted) {
        if (offset >= w[0] && offset < w[1]) {
          return true;
        }
      }
      return false;
    }

    /** Whether some offset in [low, high] is wanted. */
    boolean meets(long low, long high) {
      for (long[] w : wanted) {
        if (w[0] <= high && low < w[1]) {
          return true;
        }
      }
      return false;
    }
  }
}
