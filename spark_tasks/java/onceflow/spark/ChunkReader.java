package onceflow.spark;

import java.io.IOException;
import java.io.RandomAccessFile;
import java.nio.file.Files;
import java.nio.file.NoSuchFileException;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.nio.file.attribute.BasicFileAttributes;
import java.util.concurrent.TimeUnit;

import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.catalyst.expressions.GenericInternalRow;
import org.apache.spark.sql.connector.read.PartitionReader;
import org.apache.spark.unsafe.types.UTF8String;

/**
 * The lines of one chunk, as onceflow.sources.landing cuts them: at LF, each without one
 * trailing CR, a last line without LF included; the line at index i has offset first + i, and
 * only the wanted offsets become rows.
 */
final class ChunkReader implements PartitionReader<InternalRow> {
  private final ReadSpec.Chunk chunk;
  private final LineDecoder decoder;  // null: payload lines
  private final byte[] data;
  private int pos;
  private long offset;
  private InternalRow row;

  ChunkReader(ReadSpec.Chunk chunk, String[][] columns, long maxRecordBytes) {
    this.chunk = chunk;
    this.decoder = columns == null ? null : new LineDecoder(columns, maxRecordBytes);
    this.data = read(chunk);
    this.offset = chunk.first;
  }

  private static byte[] read(ReadSpec.Chunk chunk) {
    Path path = Paths.get(chunk.path);
    BasicFileAttributes info;
    try {
      info = Files.readAttributes(path, BasicFileAttributes.class);
    } catch (NoSuchFileException e) {
      requireFolder(path.getParent());
      throw new IllegalStateException("SourceShortfall: landed file '" + chunk.path
          + "' was removed before every batch reading it committed");
    } catch (IOException e) {
      throw new IllegalStateException("landed file '" + chunk.path + "' cannot be read: " + e);
    }
    double mtime = info.lastModifiedTime().to(TimeUnit.NANOSECONDS) / 1e9;
    if (!info.isRegularFile()) {
      throw new IllegalStateException("SourceShortfall: landed file '" + chunk.path
          + "' was removed before every batch reading it committed");
    }
    if (info.size() != chunk.size || Math.abs(mtime - chunk.mtime) > 1e-3) {
      throw new IllegalStateException("landed file '" + chunk.path
          + "' changed after it was indexed: refused");
    }
    long size = chunk.byteEnd - chunk.byteStart;
    if (size > Integer.MAX_VALUE - 8) {
      throw new IllegalStateException("landed file '" + chunk.path + "': a chunk of " + size
          + " bytes is over what one read task holds (2 GiB): index the folder with a smaller "
          + "chunk_bytes");
    }
    int length = (int) size;
    byte[] bytes = new byte[length];
    try (RandomAccessFile file = new RandomAccessFile(chunk.path, "r")) {
      file.seek(chunk.byteStart);
      file.readFully(bytes);
    } catch (IOException e) {
      throw new IllegalStateException("landed file '" + chunk.path + "' cannot be read: " + e);
    }
    return bytes;
  }

  /** onceflow.sources.folders.require_folder's refusal, in the JVM: this executor does not
   * see the landing folder at all (not mounted here), which is not a removed file. */
  private static void requireFolder(Path folder) {
    if (folder != null && !Files.isDirectory(folder)) {
      String host;
      try {
        host = java.net.InetAddress.getLocalHost().getHostName();
      } catch (IOException e) {
        host = "unknown";
      }
      throw new IllegalStateException("FolderNotVisible: the folder '" + folder
          + "' is not visible here (host " + host + "): every Airflow worker and Spark "
          + "executor must see the same folder (see docs/deployment.md); create or mount it");
    }
  }

  @Override
  public boolean next() {
    while (pos < data.length) {
      int start = pos;
      int end = start;
      while (end < data.length && data[end] != '\n') {
        end++;
      }
      pos = end + 1;  // past the LF (or past the end: a last line without one)
      if (end > start && data[end - 1] == '\r') {
        end--;
      }
      long at = offset++;
      if (chunk.wants(at)) {
        row = decoder == null ? payloadRow(start, end, at) : decoder.row(data, start, end,
            chunk.partition, at);
        return true;
      }
    }
    return false;
  }

  private InternalRow payloadRow(int start, int end, long at) {
    UTF8String payload;
    if (LineDecoder.validUtf8(data, start, end)) {
      payload = UTF8String.fromBytes(data, start, end - start);
    } else {  // bytes that are not UTF-8: replaced (U+FFFD), as Python decodes them
      payload = UTF8String.fromString(LineDecoder.replacing(data, start, end));
    }
    return new GenericInternalRow(new Object[] {chunk.partition, at, payload});
  }

  @Override
  public InternalRow get() {
    return row;
  }

  @Override
  public void close() {
  }
}
