package onceflow.spark;

import java.util.ArrayList;
import java.util.List;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;

import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.sql.types.DataType;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.types.StructField;
import org.apache.spark.sql.types.StructType;

/** The {@code spec} option of {@link JsonLinesSource}, parsed. */
final class ReadSpec {
  final List<Chunk> chunks = new ArrayList<>();
  /** [name, type] pairs; null: payload lines. */
  final String[][] columns;
  /** -1: no limit. */
  final long maxRecordBytes;

  private ReadSpec(String[][] columns, long maxRecordBytes) {
    this.columns = columns;
    this.maxRecordBytes = maxRecordBytes;
  }

  static ReadSpec parse(String json) {
    JsonNode root = root(json, "onceflow-jsonl");
    ReadSpec spec = new ReadSpec(columns(root), maxRecordBytes(root));
    List<long[]> wanted = wanted(root);
    boolean csv = root.has("csv") && root.get("csv").asBoolean();
    for (JsonNode c : root.get("chunks")) {
      // [path, crc, size, mtime, first, byte_start, byte_end, partition, records]
      int partition = c.get(7).asInt();
      long[][] mine = wantedIn(wanted, partition);
      spec.chunks.add(new Chunk(c.get(0).asText(), c.get(1).isNull() ? -1 : c.get(1).asLong(),
          c.get(2).isNull() ? -1 : c.get(2).asLong(), c.get(3).isNull() ? 0 : c.get(3).asDouble(),
          c.get(4).asLong(), c.get(5).asLong(), c.get(6).asLong(), partition, c.get(8).asLong(),
          mine, csv));
    }
    return spec;
  }

  /** The {@code columns} of a spec: [name, type] pairs, or null (payload records). */
  static String[][] columns(JsonNode root) {
    JsonNode cols = root.get("columns");
    if (cols == null || cols.isNull()) {
      return null;
    }
    String[][] columns = new String[cols.size()][];
    for (int i = 0; i < cols.size(); i++) {
      String name = cols.get(i).get(0).asText();
      String type = cols.get(i).get(1).asText();
      typeOf(type);  // refuses an unknown type here, on the driver
      columns[i] = new String[] {name, type};
    }
    return columns;
  }

  /** The JSON of a reader's {@code spec} option; {@code source} names the reader in errors. */
  static JsonNode root(String json, String source) {
    if (json == null) {
      throw new IllegalArgumentException(source + ": the spec option is missing");
    }
    try {
      return new ObjectMapper().readTree(json);
    } catch (java.io.IOException e) {
      throw new IllegalArgumentException(source + ": the spec option is not JSON: " + e);
    }
  }

  /** The [start, end) ranges of {@code wanted} ([partition, start, end] each) in one partition. */
  static long[][] wantedIn(List<long[]> wanted, int partition) {
    List<long[]> mine = new ArrayList<>();
    for (long[] w : wanted) {
      if (w[0] == partition) {
        mine.add(new long[] {w[1], w[2]});
      }
    }
    return mine.toArray(new long[0][]);
  }

  /** The {@code max_record_bytes} of a spec; -1: no limit. */
  static long maxRecordBytes(JsonNode root) {
    JsonNode max = root.get("max_record_bytes");
    return max == null || max.isNull() ? -1 : max.asLong();
  }

  /** The {@code wanted} ranges of a spec: [partition, start, end] each. */
  static List<long[]> wanted(JsonNode root) {
    List<long[]> wanted = new ArrayList<>();
    for (JsonNode w : root.get("wanted")) {
      wanted.add(new long[] {w.get(0).asLong(), w.get(1).asLong(), w.get(2).asLong()});
    }
    return wanted;
  }

  static DataType typeOf(String type) {
    switch (type) {
      case "string": return DataTypes.StringType;
      case "boolean": return DataTypes.BooleanType;
      case "tinyint": return DataTypes.ByteType;
      case "smallint": return DataTypes.ShortType;
      case "int": return DataTypes.IntegerType;
      case "bigint": return DataTypes.LongType;
      case "float": return DataTypes.FloatType;
      case "double": return DataTypes.DoubleType;
      default: throw new IllegalArgumentException("onceflow-jsonl: column type " + type
          + " is not one a JSON line decodes to");
    }
  }

  StructType schema() {
    return schema(columns);
  }

  /** The rows' schema: partition, offset, then payload, or the columns, corrupt and problem. */
  static StructType schema(String[][] columns) {
    List<StructField> fields = new ArrayList<>();
    fields.add(DataTypes.createStructField("partition", DataTypes.IntegerType, true));
    fields.add(DataTypes.createStructField("offset", DataTypes.LongType, true));
    if (columns == null) {
      fields.add(DataTypes.createStructField("payload", DataTypes.StringType, true));
    } else {
      for (String[] c : columns) {
        fields.add(DataTypes.createStructField(c[0], typeOf(c[1]), true));
      }
      fields.add(DataTypes.createStructField("_corrupt_record", DataTypes.StringType, true));
      fields.add(DataTypes.createStructField("_problem", DataTypes.StringType, true));
    }
    return DataTypes.createStructType(fields);
  }

  /**
   * One chunk of a file: bytes [byteStart, byteEnd) whose CRC-32 is crc (-1: indexed before
   * chunk checksums, then the file's size and mtime are checked), holding the records at
   * offsets [first, first + records).
   */
  static final class Chunk implements InputPartition {
    private static final long serialVersionUID = 1L;
    final String path;
    final long crc;
    final long size;
    final double mtime;
    final long first;
    final long byteStart;
    final long byteEnd;
    final int partition;
    final long records;
    /** [start, end) offset ranges of this chunk's partition to keep. */
    final long[][] wanted;
    /** CSV records (RFC 4180), not lines. */
    final boolean csv;

    Chunk(String path, long crc, long size, double mtime, long first, long byteStart,
          long byteEnd, int partition, long records, long[][] wanted, boolean csv) {
      this.csv = csv;
      this.path = path;
      this.crc = crc;
      this.size = size;
      this.mtime = mtime;
      this.first = first;
      this.byteStart = byteStart;
      this.byteEnd = byteEnd;
      this.partition = partition;
      this.records = records;
      this.wanted = wanted;
    }

    /** Where the chunk lies, as the refusals name it. */
    String where() {
      return "bytes [" + byteStart + ", " + byteEnd + ") (the chunk of offsets [" + first + ", "
          + (first + records) + ") of partition " + partition + ")";
    }

    boolean wants(long offset) {
      for (long[] w : wanted) {
        if (offset >= w[0] && offset < w[1]) {
          return true;
        }
      }
      return false;
    }
  }
}
