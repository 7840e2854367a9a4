package onceflow.spark;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.List;

import org.apache.parquet.ParquetReadOptions;
import org.apache.parquet.VersionParser;
import org.apache.parquet.column.ColumnDescriptor;
import org.apache.parquet.column.ColumnReader;
import org.apache.parquet.column.impl.ColumnReaderImpl;
import org.apache.parquet.column.page.PageReadStore;
import org.apache.parquet.column.statistics.Statistics;
import org.apache.parquet.hadoop.ParquetFileReader;
import org.apache.parquet.hadoop.metadata.BlockMetaData;
import org.apache.parquet.hadoop.metadata.ColumnChunkMetaData;
import org.apache.parquet.io.LocalInputFile;
import org.apache.parquet.io.api.Binary;
import org.apache.parquet.io.api.PrimitiveConverter;
import org.apache.parquet.schema.MessageType;
import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.connector.read.PartitionReader;

/**
 * The wanted records of one segment file, each payload decoded by {@link LineDecoder} from
 * the bytes Parquet holds (no Java string, no second pass). Only the row groups whose
 * partition and offset statistics meet the wanted ranges are read (a row group without
 * statistics is read and filtered row by row); within them, a row outside the ranges has its
 * payload skipped, not decoded.
 */
final class SegmentReader implements PartitionReader<InternalRow> {
  /** The column readers hand values over through their getters, never to a converter. */
  private static final PrimitiveConverter NO_CONVERTER = new PrimitiveConverter() { };

  private final SegmentsTable.Segment segment;
  private final LineDecoder decoder;
  private final ParquetFileReader file;
  private final ColumnDescriptor partitionColumn;
  private final ColumnDescriptor offsetColumn;
  private final ColumnDescriptor payloadColumn;
  private final VersionParser.ParsedVersion writer;
  private final int[] groups;
  private int nextGroup;
  private ColumnReader partitions;
  private ColumnReader offsets;
  private ColumnReader payloads;
  private long left;  // rows of the current row group not read yet
  private InternalRow row;

  SegmentReader(SegmentsTable.Segment segment, String[][] columns, long maxRecordBytes) {
    this.segment = segment;
    this.decoder = new LineDecoder(columns, maxRecordBytes);
    try {
      file = ParquetFileReader.open(new LocalInputFile(Paths.get(segment.path)),
          ParquetReadOptions.builder().build());
    } catch (IOException e) {
      // ROOT/TOPIC/pPARTITION/BASE.parquet: a root not mounted here says so
      java.nio.file.Path root = Paths.get(segment.path).getParent();
      for (int up = 0; up < 2 && root != null; up++) {
        root = root.getParent();
      }
      ChunkReader.requireFolder(root);
      throw failed(e);
    }
    MessageType schema = file.getFooter().getFileMetaData().getSchema();
    partitionColumn = column(schema, "partition");
    offsetColumn = column(schema, "offset");
    payloadColumn = column(schema, "payload");
    // only these columns' chunks are read from disk and decompressed (not produced_at)
    file.setRequestedSchema(new MessageType(schema.getName(), schema.getType("partition"),
        schema.getType("offset"), schema.getType("payload")));
    VersionParser.ParsedVersion parsed;
    try {
      parsed = VersionParser.parse(file.getFooter().getFileMetaData().getCreatedBy());
    } catch (VersionParser.VersionParseException | RuntimeException e) {
      parsed = null;  // (only files of old Parquet writers need their version known)
    }
    writer = parsed;
    List<Integer> kept = new ArrayList<>();
    List<BlockMetaData> blocks = file.getRowGroups();
    for (int g = 0; g < blocks.size(); g++) {
      long[] p = bounds(blocks.get(g), "partition");
      long[] o = bounds(blocks.get(g), "offset");
      if ((p == null || (p[0] <= segment.partition && segment.partition <= p[1]))
          && (o == null || segment.meets(o[0], o[1]))) {
        kept.add(g);
      }
    }
    groups = kept.stream().mapToInt(Integer::intValue).toArray();
  }

  private IllegalStateException failed(Exception e) {
    return new IllegalStateException("segment file '" + segment.path + "' (partition "
        + segment.partition + ") cannot be read: " + e);
  }

  private ColumnDescriptor column(MessageType schema, String name) {
    if (!schema.containsPath(new String[] {name})) {
      throw new IllegalStateException("segment file '" + segment.path + "' has no column "
          + name + " (a segment holds partition, offset and payload)");
    }
    return schema.getColumnDescription(new String[] {name});
  }

  /** The [min, max] statistics of a whole-number column in a row group, or null. */
  private static long[] bounds(BlockMetaData block, String name) {
    for (ColumnChunkMetaData c : block.getColumns()) {
      if (c.getPath().toDotString().equals(name)) {
        Statistics<?> s = c.getStatistics();
        if (s == null || !s.hasNonNullValue()) {
          return null;
        }
        return new long[] {((Number) s.genericGetMin()).longValue(),
                           ((Number) s.genericGetMax()).longValue()};
      }
    }
    return null;
  }

  private ColumnReader reader(PageReadStore pages, ColumnDescriptor column) {
    return new ColumnReaderImpl(column, pages.getPageReader(column), NO_CONVERTER, writer);
  }

  private static boolean present(ColumnReader reader) {
    return reader.getCurrentDefinitionLevel() == reader.getDescriptor().getMaxDefinitionLevel();
  }

  @Override
  public boolean next() {
    while (true) {
      if (left == 0) {
        if (nextGroup == groups.length) {
          return false;
        }
        PageReadStore pages;
        try {
          pages = file.readRowGroup(groups[nextGroup++]);
        } catch (IOException e) {
          throw failed(e);
        }
        left = pages.getRowCount();
        partitions = reader(pages, partitionColumn);
        offsets = reader(pages, offsetColumn);
        payloads = reader(pages, payloadColumn);
        continue;
      }
      left--;
      boolean wanted = present(partitions) && present(offsets)
          && partitions.getInteger() == segment.partition;
      long offset = wanted ? offsets.getLong() : -1;
      partitions.consume();
      offsets.consume();
      if (!wanted || !segment.wants(offset)) {
        payloads.skip();
        payloads.consume();
        continue;
      }
      if (present(payloads)) {
        Binary payload = payloads.getBinary();
        ByteBuffer bytes = payload.toByteBuffer();
        if (bytes.hasArray()) {
          int start = bytes.arrayOffset() + bytes.position();
          row = decoder.row(bytes.array(), start, start + bytes.remaining(),
              segment.partition, offset);
        } else {
          byte[] copy = payload.getBytes();
          row = decoder.row(copy, 0, copy.length, segment.partition, offset);
        }
      } else {  // (a segment's payloads are never null: an empty one, corrupt)
        row = decoder.row(new byte[0], 0, 0, segment.partition, offset);
      }
      payloads.consume();
      return true;
    }
  }

  @Override
  public InternalRow get() {
    return row;
  }

  @Override
  public void close() throws IOException {
    file.close();
  }
}
