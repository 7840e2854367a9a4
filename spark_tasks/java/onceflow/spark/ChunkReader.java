package onceflow.spark;

import java.io.FileNotFoundException;
import java.io.IOException;
import java.io.RandomAccessFile;
import java.nio.file.Files;
import java.nio.file.NoSuchFileException;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.nio.file.attribute.BasicFileAttributes;
import java.util.concurrent.TimeUnit;
import java.util.zip.CRC32;

import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.catalyst.expressions.GenericInternalRow;
import org.apache.spark.sql.connector.read.PartitionReader;
import org.apache.spark.unsafe.types.UTF8String;

/**
 * The lines of one chunk, as onceflow.sources.landing cuts them: at LF (CSV: at an LF
 * outside a quoted field, empty records skipped), each without one trailing CR, a last line
 * without LF included; the line at index i has offset first + i, and
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

  private static final String REPAIR_HINT =
      "`onceflow repair` says what changed and how to go on";

  private static IllegalStateException removed(ReadSpec.Chunk chunk) {
    requireFolder(Paths.get(chunk.path).getParent());  // a folder not mounted here says so
    return new IllegalStateException("landed file '" + chunk.path
        + "' was removed before every batch reading it committed: refused. " + REPAIR_HINT);
  }

  private static IllegalStateException changed(ReadSpec.Chunk chunk, String what) {
    return new IllegalStateException("landed file '" + chunk.path
        + "' changed after it was indexed: " + what + ": refused. " + REPAIR_HINT);
  }

  /** A chunk indexed before chunk checksums: its file's size and modification time. */
  private static void checkUnchanged(ReadSpec.Chunk chunk) {
    BasicFileAttributes info;
    try {
      info = Files.readAttributes(Paths.get(chunk.path), BasicFileAttributes.class);
    } catch (NoSuchFileException e) {
      throw removed(chunk);
    } catch (IOException e) {
      throw new IllegalStateException("landed file '" + chunk.path + "' cannot be read: " + e);
    }
    if (!info.isRegularFile()) {
      throw removed(chunk);
    }
    double mtime = info.lastModifiedTime().to(TimeUnit.NANOSECONDS) / 1e9;
    if (info.size() != chunk.size || Math.abs(mtime - chunk.mtime) > 1e-3) {
      throw changed(chunk, "its size or modification time is not the one indexed (size "
          + chunk.size + " -> " + info.size() + "; indexed before chunk checksums)");
    }
  }

  /** The chunk's bytes, checked against its CRC-32 (the bytes used are the bytes checked). */
  private static byte[] read(ReadSpec.Chunk chunk) {
    if (chunk.crc < 0) {
      checkUnchanged(chunk);
    }
    long size = chunk.byteEnd - chunk.byteStart;
    if (size > Integer.MAX_VALUE - 8) {
      throw new IllegalStateException("landed file '" + chunk.path + "': a chunk of " + size
          + " bytes is over what one read task holds (2 GiB): index the folder with a smaller "
          + "chunk_bytes");
    }
    byte[] bytes = new byte[(int) size];
    int got = 0;
    try (RandomAccessFile file = new RandomAccessFile(chunk.path, "r")) {
      file.seek(chunk.byteStart);
      while (got < bytes.length) {
        int n = file.read(bytes, got, bytes.length - got);
        if (n < 0) {
          break;
        }
        got += n;
      }
    } catch (FileNotFoundException e) {
      throw removed(chunk);
    } catch (IOException e) {
      throw new IllegalStateException("landed file '" + chunk.path + "' cannot be read: " + e);
    }
    if (got != bytes.length) {
      throw changed(chunk, "it ends at byte " + (chunk.byteStart + got) + ", before "
          + chunk.where());
    }
    if (chunk.crc >= 0) {
      CRC32 crc = new CRC32();
      crc.update(bytes, 0, bytes.length);
      if (crc.getValue() != chunk.crc) {
        throw changed(chunk, chunk.where() + " are not the bytes indexed (CRC-32 "
            + String.format("%08x", crc.getValue()) + ", indexed "
            + String.format("%08x", chunk.crc) + ")");
      }
    }
    return bytes;
  }

  /** onceflow.sources.folders.require_folder's refusal, in the JVM: this executor does not
   * see the landing folder (or segments root) at all (not mounted here), which is not a
   * removed file. */
  static void requireFolder(Path folder) {
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

  /** Where the record from {@code start} ends: at the first LF outside a quoted field (CSV,
   * RFC 4180: a field that starts with a quote runs to its closing quote, {@code ""} within
   * it is a quote), or the chunk's end. onceflow.sources.landing._csv_records cuts the same. */
  private int csvEnd(int start) {
    boolean inside = false;
    boolean fieldStart = true;
    int end = start;
    while (end < data.length) {
      byte b = data[end];
      if (inside) {
        if (b == '"') {
          if (end + 1 < data.length && data[end + 1] == '"') {
            end++;
          } else {
            inside = false;
          }
        }
        fieldStart = false;
      } else if (b == '\n') {
        break;
      } else {
        inside = b == '"' && fieldStart;
        fieldStart = b == ',';
      }
      end++;
    }
    return end;
  }

  @Override
  public boolean next() {
    while (pos < data.length) {
      int start = pos;
      int end = start;
      if (chunk.csv) {
        end = csvEnd(start);
      } else {
        while (end < data.length && data[end] != '\n') {
          end++;
        }
      }
      pos = end + 1;  // past the LF (or past the end: a last line without one)
      if (end > start && data[end - 1] == '\r') {
        end--;
      }
      if (chunk.csv && end == start) {
        continue;  // an empty line is no CSV record
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
